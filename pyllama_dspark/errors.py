"""Exceptions raised by pyllama-dspark.

Everything that llama.cpp would turn into an abort (GGML_ASSERT) is checked in Python first and
raised as one of these instead.
"""


class DSparkError(Exception):
    """Base class of every error raised by pyllama-dspark."""


class ModelFileError(DSparkError, ValueError):
    """A model file is missing, is not a GGUF file, or is truncated / unreadable."""


class DraftMismatchError(DSparkError, ValueError):
    """The draft GGUF does not fit the target (n_embd, vocab, tokenizer, layer ids, arch)."""


class UnsupportedArchError(DraftMismatchError):
    """The target architecture cannot expose layer inputs to a DFlash/DSpark draft."""


class ContextOverflowError(DSparkError, ValueError):
    """The prompt (plus what must be generated) does not fit in the context."""


class NativeError(DSparkError, RuntimeError):
    """A call into llama.cpp or the shim failed (carries the shim's last-error string)."""


class ClosedError(DSparkError, RuntimeError):
    """An object was used after close()."""
