"""The llama.cpp layer: the shim's C prototypes (``_native``), owned handles with ``close()``
(``handles``; ``borrowed``: a target context owned by llama-cpp-python), draft metadata
(``draft_meta``), backend set-up and file checks (``backend``), model loading (``models``, ``amx``)
and llama-cpp-python's chat templates (``chat``).  Everything that calls into C lives here."""
