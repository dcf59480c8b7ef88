"""The llama.cpp layer: the shim's C prototypes (``_native``), owned handles with ``close()``
(``handles``), model loading (``models``, ``amx``) and llama-cpp-python's chat templates (``chat``).
Everything that calls into C lives here."""
