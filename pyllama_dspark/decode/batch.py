"""The batched decoder under its earlier name: decoding R sequences is the one loop (:mod:`.loop`)."""

from pyllama_dspark.decode.cycle import Started  # noqa: F401
from pyllama_dspark.decode.loop import Decoder as BatchDecoder  # noqa: F401

__all__ = ["BatchDecoder", "Started"]
