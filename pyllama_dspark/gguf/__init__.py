"""GGUF files: opening them and decoding metadata (``reader``), the layer-input archs (``layer_inputs``),
a target's (``target_info``) and a draft's metadata and its fit to a target (``info``), the inspect
report (``report``), writing atomically (``write``), random-weight targets (``target_archs``,
``target_tokenizer``, ``target_writer``) and drafts (``testing``) for tests.  No llama.cpp context is
opened here, except by the test diagnostic ``router_margins`` (it decodes one batch of a target)."""
