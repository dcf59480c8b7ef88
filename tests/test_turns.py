"""tests/turns.py on a suite of its own, two pytest-xdist workers: the tests of an ``exclusive`` file
run while no other test runs, and the same suite with the mark taken off overlaps (the check bites)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CONFTEST = '''
from turns import pytest_runtest_protocol  # noqa: F401

def pytest_configure(config):
    config.addinivalue_line("markers", "exclusive: runs alone")
'''

TIMED = '''
import json, os, time
import pytest
{mark}

@pytest.mark.parametrize("i", range({n}))
def test_timed(i):
    t0 = time.time()
    time.sleep({s})
    with open(os.environ["TURNS_LOG"], "a") as f:
        f.write(json.dumps(["{name}", t0, time.time()]) + "\\n")
'''


def _intervals(tmp_path: Path, exclusive: bool) -> dict:
    suite = tmp_path / ("on" if exclusive else "off")
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\naddopts =\n")
    (suite / "conftest.py").write_text(CONFTEST)
    mark = "pytestmark = pytest.mark.exclusive" if exclusive else ""
    (suite / "test_alone.py").write_text(TIMED.format(mark=mark, n=3, s=0.6, name="alone"))
    (suite / "test_many.py").write_text(TIMED.format(mark="", n=30, s=0.1, name="many"))
    log = suite / "log.jsonl"
    env = {**os.environ, "TURNS_LOG": str(log), "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider", "."],
                       cwd=suite, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out: dict = {"alone": [], "many": []}
    for line in log.read_text().splitlines():
        name, t0, t1 = json.loads(line)
        out[name].append((t0, t1))
    assert len(out["alone"]) == 3 and len(out["many"]) == 30, out
    return out


def _overlaps(runs: dict) -> int:
    return sum(1 for a0, a1 in runs["alone"] for m0, m1 in runs["many"] if m0 < a1 and a0 < m1)


def test_exclusive_tests_run_alone(tmp_path):
    assert _overlaps(_intervals(tmp_path, exclusive=True)) == 0
    # the control: the same suite unmarked runs the two files side by side
    assert _overlaps(_intervals(tmp_path, exclusive=False)) > 0
