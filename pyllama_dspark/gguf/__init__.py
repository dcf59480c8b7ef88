"""GGUF files: reading draft / target metadata and checking a pair (``info``), writing atomically
(``write``), random-weight targets and drafts for tests (``target_writer``, ``testing``).  No
llama.cpp context is opened here."""
