"""What ``-md`` names, parsed once into a :class:`DraftSpec` that the rest of the package is handed.

The text users type after ``-md`` (and pass as ``draft_path`` to the Python API) is one of:

* a GGUF path;
* ``random``, ``random-dspark`` or ``random-dflash``, each with an optional ``:TYPE``
  (:data:`~pyllama_dspark.gguf.draft_types.DRAFT_TYPES`, e.g. ``random:q8_0``): a random-weight
  draft of that kind matched to the target, written once into the cache;
* ``oracle:P`` or ``oracle:P:TYPE``: the oracle proposer (the target's own greedy continuation,
  each block entirely right with probability P), paying a real pass of a draft: the shipped drafter
  for the default target, else a random DSpark draft (of ``TYPE`` when given, for any target).

``serve --spec-type draft-dflash`` (and ``bench``'s ``dflash`` configuration) adds the DFlash mode:
the draft's Markov and confidence heads removed (:mod:`.dflash_mode`).

:func:`parse_draft` reads the text (a ValueError names what is wrong); :meth:`DraftSpec.file` is the
GGUF to load beside a target, written first when it is a generated one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional, Union

from pyllama_dspark.gguf.draft_types import DRAFT_TYPES, check_draft_type

__all__ = ["DraftSpec", "parse_draft", "RANDOM_KINDS"]

#: ``-md`` names of the random drafts -> the draft kind
RANDOM_KINDS = {"random": "dspark", "random-dspark": "dspark", "random-dflash": "dflash"}
ORACLE = "oracle"
_ORACLE_FORM = "expected oracle:P with P in [0, 1], e.g. oracle:0.9"


@dataclass(frozen=True)
class DraftSpec:
    """One parsed ``-md`` value.  Exactly one of ``path`` (a file), ``random_kind`` (``dspark`` /
    ``dflash``) and ``oracle_p`` is set; ``weight_type`` is a generated draft's type (None: BF16)."""

    text: str
    path: Optional[str] = None
    random_kind: Optional[str] = None
    oracle_p: Optional[float] = None
    weight_type: Optional[str] = None
    dflash_mode: bool = False

    @property
    def is_oracle(self) -> bool:
        return self.oracle_p is not None

    def __str__(self) -> str:
        return self.text

    def as_dflash_mode(self) -> "DraftSpec":
        """The same draft in DFlash mode (its Markov and confidence heads removed)."""
        return replace(self, dflash_mode=True)

    def file(self, target: Union[str, os.PathLike]) -> str:
        """The GGUF file to load beside ``target``: the path itself, or the generated draft (written
        into the cache when missing); in DFlash mode its copy without the DSpark heads.  For an
        oracle, the draft whose pass it pays."""
        from pyllama_dspark.drafts import made

        target = os.fspath(target)
        if self.path is not None:
            f = self.path
        elif self.random_kind is not None:
            f = made.random_draft_for(target, self.random_kind, self.weight_type)
        else:
            f = made.oracle_draft_for(target, self.weight_type)
        if self.dflash_mode:
            from pyllama_dspark.drafts.dflash_mode import dflash_mode_draft

            f = dflash_mode_draft(f)
        return f


def _weight_type(text: str, value: str) -> str:
    try:
        return check_draft_type(value)
    except ValueError:
        raise ValueError(f"{text!r}: unknown draft weight type {value!r}; choose from "
                         f"{', '.join(DRAFT_TYPES)}") from None


def _oracle_p(text: str, value: str) -> float:
    try:
        p = float(value)
    except ValueError:
        raise ValueError(f"{text!r}: {_ORACLE_FORM}") from None
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{text!r}: P must be in [0, 1]")
    return p


def parse_draft(value: Union[None, str, os.PathLike, DraftSpec], *, dflash_mode: bool = False) -> Optional[DraftSpec]:
    """``value`` (what ``-md`` got, a path, or an already parsed spec) as a :class:`DraftSpec`; None
    for None.  ``dflash_mode``: the draft in DFlash mode.  ValueError on a malformed generated-draft
    name (an unknown ``:TYPE``, an oracle without a P in [0, 1])."""
    if value is None:
        return None
    if isinstance(value, DraftSpec):
        return value.as_dflash_mode() if dflash_mode else value
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise TypeError(f"a draft is named by a path or a string, got {type(value).__name__}")
    parts = value.split(":")
    head = parts[0]
    if head in RANDOM_KINDS:
        if len(parts) > 2:
            raise ValueError(f"{value!r}: expected {head}:TYPE with the weight type one of {', '.join(DRAFT_TYPES)}")
        wt = _weight_type(value, parts[1]) if len(parts) == 2 else None
        return DraftSpec(value, random_kind=RANDOM_KINDS[head], weight_type=wt, dflash_mode=dflash_mode)
    if head == ORACLE:
        if len(parts) < 2 or not parts[1]:
            raise ValueError(f"{value!r}: {_ORACLE_FORM}")
        if len(parts) > 3:
            raise ValueError(f"{value!r}: expected oracle:P:TYPE with the weight type one of {', '.join(DRAFT_TYPES)}")
        wt = _weight_type(value, parts[2]) if len(parts) == 3 else None
        return DraftSpec(value, oracle_p=_oracle_p(value, parts[1]), weight_type=wt, dflash_mode=dflash_mode)
    return DraftSpec(value, path=value, dflash_mode=dflash_mode)
