"""Interoperability with Hugging Face drafter checkpoints: ``convert`` (checkpoint -> draft GGUF) and
``export`` (draft GGUF -> checkpoint)."""
