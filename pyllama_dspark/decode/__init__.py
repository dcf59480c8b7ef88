"""The decoding loops (``engine``: one sequence, ``batch``: R sequences) and what a cycle of
either shares (``cycle``: the Chunk / Done events, Stats, incremental text with stop strings, the
lazily built verify rows of the sampled accept rule), llama-server's ``timings`` (``timings``) and
the Python entry point ``Speculator`` (``api``)."""
