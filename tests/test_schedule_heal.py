"""A schedule a busy machine cannot poison, each run a fresh process as users run ``run``,
with none of the suite's variables (the schedule's memory on, the cost curve measured and cached).

A first run from an empty cache measures the curve and learns; a second, from that cache, is the
reference: what ``auto`` decides from a clean start.  Then the same cache poisoned as a busy
machine poisons it (the figures of the issue: a spiky curve measured beside a pip build and a
learned draft pass of 139 ms; every verify size B > 1 inflated 10x; the learned draft pass at 100x
its cost): within N = 16 cycles ``auto`` decides as from the clean cache (the share of drafting
cycles within 15 points, the verify lengths alike), the output is the target's greedy output, and
the cache left on disk is healed.  N = 16: a rejected curve is measured again before the first
cycle, a learned draft pass no drafter can have is dropped at restore (two passes then measure
it), and a restored cycle cost is judged on its first 3 cycles.

The target is the real SmolLM2 with ``-md oracle:0.9`` (a real draft pass, a block right 9 times
in 10): drafting pays on a 2-core CPU (1.78x in the README).  Contention at measure time: a curve
measured while a CPU burner runs beside it is rejected for that reason, never cached.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from first_run import user_env
from poison import POISONS
from pyllama_dspark.speculative import costprofile

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a short story about a dragon who learns to paint."
N = 16
# the runs read the cycles they time: the suite's other worker waits while they run (tests/conftest.py)
pytestmark = pytest.mark.exclusive


def _run(target, cache: Path) -> dict:
    argv = [sys.executable, "-m", "pyllama_dspark.cli.main", "run", "-m", target, "-md", "oracle:0.9", "-p", PROMPT,
            "-n", "192", "--temp", "0", "--ignore-eos", "-t", "1", "-c", "1024", "--json"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=user_env(cache), cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    out["stderr"] = p.stderr
    return out


def _files(cache: Path):
    d = cache / "profiles"
    curves = [f for f in d.glob("*.json") if not f.name.startswith("learned-")]
    learned = list(d.glob("learned-*.json"))
    return curves, learned


def _share(vl):
    tail = vl[N:]
    return sum(1 for v in tail if v) / max(1, len(tail)), float(np.mean(tail)) if tail else 0.0


@pytest.fixture(scope="module")
def clean(target_path, tmp_path_factory):
    """(the clean cache after a first run, the reference run from it)."""
    base = tmp_path_factory.mktemp("heal")
    first = base / "first"
    _run(target_path, first)
    curves, learned = _files(first)
    assert len(curves) == 1 and len(learned) == 1, (curves, learned)
    for attempt in range(3):
        # the reference is the baseline, not what is tested: a burst of load from the suite's other
        # worker can make auto stop drafting for a while in one run (it reads the cycles it times);
        # such a run is measured again, from a fresh copy of the clean cache
        ref_cache = base / f"ref{attempt}"
        shutil.copytree(first, ref_cache)
        ref = _run(target_path, ref_cache)
        if _share(ref["stats"]["verify_lengths"])[0] > 0.5:
            break
    return first, ref


def _poisoned(poison, first, cache):
    """A copy of the clean cache, poisoned; (its curve and learned files, the curve before and after)."""
    shutil.copytree(first, cache)
    (curve_f,), (learned_f,) = _files(cache)
    curve, learned = json.loads(curve_f.read_text()), json.loads(learned_f.read_text())
    clean_curve = list(curve["verify_ms"])
    poison(curve, learned)
    curve_f.write_text(json.dumps(curve))
    learned_f.write_text(json.dumps(learned))
    return clean_curve, curve


def _near(got, ref) -> bool:
    """Decides as from the clean cache: drafting in as many cycles (within 15 points: a poison that
    did not heal stops drafting, share ~0), with verify lengths alike.  The lengths get 2 drafts of
    room: the block auto asks for (3, 5 or 7) follows cycle costs that move by 10-20% on a 2-core
    machine: a fresh-clone CI run saw healed runs (drafting in every cycle) average 2.8 and 6.2 drafts
    a cycle where the reference averaged 4.5."""
    (share, mean), (ref_share, ref_mean) = _share(got["stats"]["verify_lengths"]), _share(ref["stats"]["verify_lengths"])
    return abs(share - ref_share) <= 0.15 and abs(mean - ref_mean) <= max(2.0, 0.4 * ref_mean)


@pytest.mark.parametrize("poison", list(POISONS.values()), ids=list(POISONS))
def test_a_poisoned_cache_heals(poison, clean, target_path, tmp_path):
    first, ref = clean
    assert _share(ref["stats"]["verify_lengths"])[0] > 0.5, \
        f"drafting does not pay in the clean reference: {ref['stats']['verify_lengths']}"
    for attempt in range(3):
        # the runs read the cycles they time (the other worker waits meanwhile, but its idle servers
        # and the machine's own noise stay): a run whose schedule a slow spell held off the
        # reference's is made again from a fresh poisoned copy, up to three times (a heal that does
        # not work fails all three)
        cache = tmp_path / f"cache{attempt}"
        clean_curve, curve = _poisoned(poison, first, cache)
        got = _run(target_path, cache)
        print(poison.__name__, attempt, got["stats"]["verify_lengths"], ref["stats"]["verify_lengths"],
              got["stderr"][-600:])
        assert got["tokens"] == ref["tokens"], "not the target's greedy output"
        if _near(got, ref):
            break
    assert _near(got, ref), (got["stats"]["verify_lengths"], ref["stats"]["verify_lengths"])
    # the cache left behind: the poisoned curve replaced by one that passes (or gone: measured again
    # next time, never cached as it was), the learned draft pass near the clean one
    curves, (healed_f,) = _files(cache)
    for f in curves:
        assert not costprofile.problems(costprofile.load(f)), f.read_text()
        if curve["verify_ms"] != clean_curve:
            assert json.loads(f.read_text())["verify_ms"] != curve["verify_ms"], "the poisoned curve is still cached"
    clean_state = json.loads(_files(first)[1][0].read_text())["state"]
    healed = json.loads(healed_f.read_text())["state"]
    for r, ms in clean_state["draft_ms"].items():
        assert healed["draft_ms"][r] < 3.0 * ms, (healed["draft_ms"], clean_state["draft_ms"])


def _burn(until: float) -> None:
    x = 0
    while time.time() < until:
        x += 1


def test_a_curve_measured_beside_a_cpu_burner_is_rejected_for_it(target_path, monkeypatch, tmp_path):
    """A CPU burner beside the measurement (bounded: started and stopped here): the curve is
    rejected because other processes kept the cores busy, measured once more (still contended),
    and not cached."""
    from pyllama_dspark.decode.api import Speculator

    monkeypatch.delenv(costprofile.PROFILE_ENV, raising=False)
    monkeypatch.setenv("PYLLAMA_DSPARK_CACHE", str(tmp_path))
    with Speculator(target_path, None, n_ctx=512, n_threads=2) as sp:
        burners = [mp.Process(target=_burn, args=(time.time() + 120,))]   # one: the measurement has no spare core
        for b in burners:
            b.start()
        try:
            msgs = []
            prof = costprofile.auto_profile(sp.target, echo=msgs.append, progress=False)
        finally:
            for b in burners:
                b.terminate()
                b.join()
        path = costprofile.default_path(costprofile.target_key(sp.target))
    assert not path.exists(), "a contended curve was cached"
    assert prof.load["others_cores"] > 0.3, prof.load
    rejected = [m for m in msgs if "rejected" in m]
    assert len(rejected) == 2 and all("other processes kept" in m for m in rejected), msgs
    assert "not cached" in rejected[-1]
