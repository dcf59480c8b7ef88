"""``pyllama-dspark`` in a fresh process, as a user runs it (from this source tree)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, env=None, timeout: int = 600) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "pyllama_dspark.cli.main", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=e, cwd=ROOT)
