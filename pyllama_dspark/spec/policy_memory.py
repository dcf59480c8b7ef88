"""What the automatic schedule learned, kept across processes.

``pyllama-dspark run`` is one process per prompt.  Without a memory every process would start from
the optimistic prior (acceptance 0.9 at every position), pay a cold draft pass and a probe or two,
and learn again that this drafter does not pay on this machine.  So the learned state of a
cost-driven policy (:meth:`~.policy.VerifyPolicy.learned`: acceptance per position and its weight,
the confidence correction, the draft pass time per R, the probe back-off) is written at close into
the cache beside the cost curve, and the next process with the same target, settings, draft,
proposer, block and sampling regime starts from it.

Files: ``<cache>/profiles/learned-<key>.json``; ``$PYLLAMA_DSPARK_SCHEDULE_MEMORY=0`` neither reads nor
writes them (the test suite sets it, so that one test's runs do not steer another's).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Optional

from pyllama_dspark.spec import costprofile

MEMORY_ENV = "PYLLAMA_DSPARK_SCHEDULE_MEMORY"
MEMORY_VERSION = 1


def enabled() -> bool:
    return os.environ.get(MEMORY_ENV, "1").strip().lower() not in ("0", "off", "no", "false")


def memory_key(target, draft_path: Optional[str], proposer: str, gamma: int, mode: str, regime: str) -> str:
    """The target with its context settings (the cost curve's key), the draft file, the proposer
    (e.g. ``oracle:0.9``), the block, the schedule and the sampling regime (``greedy`` /
    ``sampled`` / ``any``): acceptance depends on all of them."""
    raw = json.dumps([MEMORY_VERSION, costprofile.target_key(target), costprofile._file_id(draft_path), proposer,
                      int(gamma), mode, regime])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def memory_file(key: str) -> Path:
    return costprofile.default_path(key).with_name(f"learned-{key}.json")


def attach(policy, target, draft_path: Optional[str], proposer: str, regime: str = "any") -> bool:
    """Bind ``policy`` to its memory file and start it from what is stored there; True when it
    restored something.  Does nothing (False) when the memory is off or the policy is not
    cost-driven."""
    if policy is None or not policy.uses_cost or not enabled():
        return False
    path = memory_file(memory_key(target, draft_path, proposer, policy.gamma, policy.mode, regime))
    policy.memory_path = str(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(data, dict) or data.get("version") != MEMORY_VERSION:
        return False
    return policy.restore(data.get("state") or {})


def save(policy) -> bool:
    """Write what ``policy`` learned to its memory file (atomically; the last process to close
    wins).  Nothing is written for a policy that saw no cycle in this process."""
    path = getattr(policy, "memory_path", None)
    if policy is None or not path or not enabled() or policy._cycles == 0:
        return False
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=p.name, suffix=".tmp", dir=p.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"version": MEMORY_VERSION, "state": policy.learned()}, f)
        os.replace(tmp, p)
    except OSError:   # a read-only cache: the next process learns again, nothing worse
        return False
    return True
