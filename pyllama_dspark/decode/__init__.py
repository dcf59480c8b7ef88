"""The decoding loops (``engine``: one sequence, ``batch``: R sequences), their stats in
llama-server's ``timings`` form (``timings``) and the Python entry point ``Speculator`` (``api``)."""
