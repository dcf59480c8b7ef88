"""GGUF files: reading draft / target metadata and checking a pair (``info``), writing atomically
(``write``), random-weight targets and drafts for tests (``target_writer``, ``testing``) and the
DFlash-mode copy of a DSpark draft (``dflash_mode``).  No llama.cpp context is opened here."""
