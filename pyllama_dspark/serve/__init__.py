"""The OpenAI-compatible server (llama-server's API and ``timings``): request parsing, response
formats, the per-slot and continuous-batching pools."""
