"""Benchmark prompt sets (``{"turns": [...]}`` JSONL files, e.g. DeepSpec's eval sets)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

CATEGORIES = {"gsm8k": "math", "math500": "math", "humaneval": "code", "mbpp": "code", "mt-bench": "chat"}


@dataclass
class PromptItem:
    source: str          # file stem, e.g. "gsm8k"
    category: str        # math / code / chat / other
    index: int           # line number in the file
    turns: List[str]


#: The benchmark prompts shipped inside the package (DeepSpec's eval sets, MIT; see its README).
PACKAGED_PROMPT_DIR = Path(__file__).resolve().parent / "data" / "prompts"


def default_prompt_dir() -> Optional[Path]:
    """$PYLLAMA_DSPARK_PROMPTS if set, else the prompt files shipped in the package."""
    env = os.environ.get("PYLLAMA_DSPARK_PROMPTS")
    cands = [Path(env)] if env else []
    cands.append(PACKAGED_PROMPT_DIR)
    for c in cands:
        if c.is_dir() and any(c.glob("*.jsonl")):
            return c
    return None


def _files(paths: Iterable) -> List[Path]:
    out: List[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            out += sorted(p.glob("*.jsonl"))
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"prompt file or directory not found: {p}")
    return out


def load_prompts(paths: Sequence = (), limit_per_file: Optional[int] = None) -> List[PromptItem]:
    if not paths:
        d = default_prompt_dir()
        if d is None:
            raise FileNotFoundError("no prompt directory: pass prompt files or set PYLLAMA_DSPARK_PROMPTS")
        paths = [d]
    items: List[PromptItem] = []
    for f in _files(paths):
        n = 0
        with open(f, encoding="utf-8") as fh:
            for i, line in enumerate(fh):
                line = line.strip()
                if not line:
                    continue
                obj = json.loads(line)
                turns = obj.get("turns") if isinstance(obj, dict) else None
                if not turns or not all(isinstance(t, str) for t in turns):
                    raise ValueError(f"{f}:{i + 1}: expected {{\"turns\": [str, ...]}}")
                items.append(PromptItem(f.stem, CATEGORIES.get(f.stem, "other"), i, list(turns)))
                n += 1
                if limit_per_file is not None and n >= limit_per_file:
                    break
    return items
