"""Measuring and comparing: ``bench`` and its report, ``crosscheck`` against ``Llama`` and
llama-server, the llama-server harness (``llama_server_sdist``: its llama.cpp sources,
``llama_server_build``: the build, ``llama_server``: the running server, ``llama_server_log``: its
log's speculative-decoding lines) and the numpy reference of the draft graph."""
