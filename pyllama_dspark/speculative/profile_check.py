"""Whether a measured verify cost curve can be trusted, and cached: what the machine did while it
was measured, the curve's own shape and spread, and who made it.

A curve measured while other processes ran is what the schedule plans with for good once cached
(every later run starts from the file), so :func:`problems` lists every reason not to keep one:

* **contention** (:class:`LoadWatch`, Linux ``/proc/stat`` over the CPUs this process may use):
  other processes kept busy more cores than the measurement left spare, or the hypervisor took
  CPU time (steal).  llama.cpp's threads spin-wait: behind other work every decode waits alike;
* **shape** (a CPU curve): flat (a busy machine makes every decode equally slow), a size out of
  line with the rest (a smaller batch slower than a larger one beyond noise, a jump between
  neighbours), or B rows costing more than B single-row decodes by far;
* **spread**: the p10-p90 spread of the sizes read several times, when most of it is noise;
* **provenance** (:func:`stale`): a curve made by another llama-cpp-python or pyllama-dspark.

GPU curves can be flat and jitter on their own: only contention and provenance apply there.
"""

from __future__ import annotations

import os
import resource
import time
from typing import List, Optional

import numpy as np

#: other processes may use the cores the measurement leaves spare plus this many more, on average
SPARE_SLACK_CORES = 0.3
#: CPU time the hypervisor may take (steal), in cores, on average
STEAL_CORES = 0.25
#: a CPU curve within this factor of flat (t(B_max) / t(1)) is what contention gives
FLAT = 1.5
#: B rows in one decode cost at most this many times B single-row decodes
SUPERLINEAR = 1.5
#: a size may cost at most this many times a larger one (its neighbours' noise is a few %)
OUT_OF_LINE = 1.4
#: t(B) over t(B - 1) may be at most this many times what linear growth gives
JUMP = 1.6
#: the median p90 / p10 over the sizes read at least SPREAD_READINGS times
SPREAD = 1.5
SPREAD_READINGS = 3

_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpus() -> set:
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def _jiffies(cpus: set) -> Optional[tuple]:
    """(busy, steal) jiffies summed over ``cpus`` from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = steal = 0
    seen = False
    for line in lines:
        parts = line.split()
        if not parts or not parts[0].startswith("cpu") or parts[0] == "cpu":
            continue
        try:
            if int(parts[0][3:]) not in cpus:
                continue
            v = [int(x) for x in parts[1:]]
        except ValueError:
            continue
        # user nice system idle iowait irq softirq steal (guest time is inside user)
        busy += v[0] + v[1] + v[2] + (v[5] + v[6] if len(v) > 6 else 0)
        steal += v[7] if len(v) > 7 else 0
        seen = True
    return (busy, steal) if seen else None


def _own_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)   # every thread of this process (llama.cpp's too)
    return ru.ru_utime + ru.ru_stime


def _loadavg() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


class LoadWatch:
    """What the machine did from construction to :meth:`stop`: wall time, this process's CPU time,
    the cores other processes kept busy, the hypervisor's steal (cores, on average), the load."""

    def __init__(self):
        self.cpus = _cpus()
        self._load = _loadavg()
        self._stat = _jiffies(self.cpus)
        self._own = _own_cpu_s()
        self._t = time.monotonic()

    def stop(self) -> dict:
        wall = time.monotonic() - self._t
        own = _own_cpu_s() - self._own
        stat = _jiffies(self.cpus)
        out = dict(wall_s=round(wall, 3), cpu_s=round(own, 3), n_cpus=len(self.cpus),
                   loadavg=[self._load, _loadavg()])
        if stat is not None and self._stat is not None and wall > 0:
            busy = (stat[0] - self._stat[0]) / _CLK
            out["others_cores"] = round(max(0.0, busy - own) / wall, 3)
            out["steal_cores"] = round(max(0.0, (stat[1] - self._stat[1]) / _CLK) / wall, 3)
        return out


def made_by() -> dict:
    """The versions a curve is measured with (a curve made by others is measured again)."""
    import sys

    import llama_cpp

    pkg = sys.modules.get(__name__.split(".")[0])   # the package, imported before any of its modules
    return {"llama_cpp": str(getattr(llama_cpp, "__version__", "?")),
            "pyllama_dspark": str(getattr(pkg, "__version__", "?"))}


def contention(load: dict, threads: int) -> List[str]:
    """Why the machine was not quiet while the curve was measured (``load``: :meth:`LoadWatch.stop`)."""
    out = []
    n = int(load.get("n_cpus") or 0)
    others = load.get("others_cores")
    if others is not None and n and others > max(0, n - max(1, threads)) + SPARE_SLACK_CORES:
        out.append(f"other processes kept {others:.1f} of {n} cores busy while it ran "
                   f"(it needs {max(1, threads)}, {max(0, n - max(1, threads))} spare)")
    steal = load.get("steal_cores")
    if steal is not None and steal > STEAL_CORES:
        out.append(f"the hypervisor took {steal:.2f} cores (steal) while it ran")
    return out


def shape(verify_ms, p10=None, p90=None, readings=None) -> List[str]:
    """Why a CPU curve (median ms per B = 1..) is not what verifying B rows costs on a quiet machine."""
    v = np.asarray(verify_ms, dtype=np.float64)
    if v.size < 2 or not np.all(np.isfinite(v)) or np.any(v <= 0):
        return ["the curve has missing or non-positive times"] if v.size else []
    out = []
    if v.size >= 4 and v[-1] < FLAT * v[0]:
        out.append(f"flat: {v.size} rows cost {v[-1] / v[0]:.2f}x one row (a busy machine makes every decode "
                   f"equally slow)")
    b = np.arange(1, v.size + 1)
    over = np.flatnonzero(v > SUPERLINEAR * b * v[0] + 0.5)
    if over.size:
        k = int(over[0])
        out.append(f"B = {k + 1} costs {v[k] / v[0]:.1f}x one row (more than {SUPERLINEAR:g}x B single rows)")
    later_min = np.minimum.accumulate(v[::-1])[::-1]   # min over B' >= B
    for k in range(v.size - 1):
        if v[k] > OUT_OF_LINE * later_min[k + 1]:
            j = k + 1 + int(np.argmin(v[k + 1:]))
            out.append(f"B = {k + 1} ({v[k]:.1f} ms) costs {v[k] / v[j]:.2f}x B = {j + 1} ({v[j]:.1f} ms)")
            break
    for k in range(2, v.size):
        if v[k] > JUMP * v[k - 1] * (k + 1) / k:
            out.append(f"B = {k + 1} ({v[k]:.1f} ms) jumps {v[k] / v[k - 1]:.2f}x over B = {k} ({v[k - 1]:.1f} ms)")
            break
    if p10 is not None and p90 is not None and readings:
        lo, hi, n = (np.asarray(x, dtype=np.float64) for x in (p10, p90, readings))
        use = (n >= SPREAD_READINGS) & (lo > 0)
        if use.sum() >= 2:
            s = float(np.median(hi[use] / lo[use]))
            if s > SPREAD:
                out.append(f"noisy: p90 / p10 is {s:.2f} over the sizes read {SPREAD_READINGS}+ times")
    return out


def stale(made: dict) -> List[str]:
    """Why a curve made with ``made`` (a profile's ``made_by``) is not this install's."""
    now = made_by()
    if not made:
        return ["it records no versions (an older cache)"]
    diff = [f"{k} {made.get(k)} (now {v})" for k, v in now.items() if made.get(k) != v]
    return [f"made by {', '.join(diff)}"] if diff else []
