"""llama.cpp's own programs, built on the installed llama-cpp-python's libraries from its sdist's sources
and driven as references: llama-server (``llama_server_sdist``: the sources, ``llama_server_build`` /
``llama_server_linked``: the build, ``llama_server``: the running server, ``llama_server_log``: its
log's speculative-decoding lines) and the RPC module and server (``rpc_build``)."""
