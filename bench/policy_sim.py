"""Where ``auto`` loses to the best fixed block, without the machine's noise: the shipped policy
(:class:`~pyllama_dspark.speculative.policy.VerifyPolicy`, ``auto``) driven by a simulated machine.

    python bench/policy_sim.py [--json docs/where_dspark_pays_17b_xeon_curve3.json] [--p 0.3,...]
        [--samples 12] [-n 40] [--seeds 8] [--drift 0.1] [--noise 0.08] [--profile-speed 1.3]
        [--set field=value[;field=value] ...]

On a 2-core CPU one configuration's tok/s moves by 10-30% within minutes, so a sweep cell's median
of 12 samples moves by about 10%, more than the 5% ``auto`` is asked to stay within.  Here the
target and the drafter are a model fitted to a sweep's own measurements (``--json``: the cost curve
t(k) and the draft pass per block size of a ``bench/where_dspark_pays.py`` run), the proposer is
``-md oracle:P`` exactly (the full block of 7 right with probability P, else one wrong draft at a
uniform position; a block of n its first n), and the machine's speed follows a slow random walk
(``--drift``: its standard deviation, a mean-reverting log-speed with a 60 s time constant) with
per-cycle noise (``--noise``, lognormal, and a 2% chance of a 1.5-3x stall).  Every configuration
of a sample runs on the same machine path and the same oracle draws (paired exactly); ``auto``
keeps its policy across the samples (a server, or the memory), its cost profile read at
``--profile-speed`` times the true curve (a cached profile from a slower moment).

Columns, as tok/s over no draft (median over samples, mean over seeds): every fixed block, ``auto``
as shipped, then ``auto`` with one input replaced by the truth, which says where a loss comes from:
- ``true costs``: the plan reads the machine's real cycle and pass costs at this moment;
- ``true acc``: the plan reads the oracle's real acceptance per position (no estimate, no optimism);
- ``true both``: Algorithm 1 on the truth, the limit of the cost model itself;
- ``no explore``: ``explore_band=0`` (no block tried off the plan);
- ``auto field=value``: one per ``--set``, auto with those policy fields set (an A/B on the same
  machine paths, e.g. ``--set probe_plan=0 --set "forget_cycles=0;ema=0.05"``).
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

from pyllama_dspark.speculative.policy import VerifyPolicy
from pyllama_dspark.speculative.schedule import CostModel

GAMMA = 7
INJECT_MS = (1.0, 7.0)   # accept + inject per plain / drafting cycle (the 1.7B's cycle parts: 6-8 ms)


class Machine:
    """Speed(t) = exp(x(t)), x an Ornstein-Uhlenbeck path (60 s), sampled on a 1 s grid."""

    def __init__(self, rng, drift: float, noise: float, seconds: int = 20000):
        x = np.zeros(seconds)
        a = math.exp(-1 / 60.0)
        step = drift * math.sqrt(1 - a * a)
        z = rng.standard_normal(seconds)
        for i in range(1, seconds):
            x[i] = a * x[i - 1] + step * z[i]
        self.speed = np.exp(x)
        self.noise = noise

    def ms(self, rng, base: float, now_ms: float) -> float:
        s = self.speed[min(int(now_ms / 1e3), self.speed.size - 1)]
        stall = rng.uniform(1.5, 3.0) if rng.random() < 0.02 else 1.0
        return base * s * math.exp(self.noise * rng.standard_normal()) * stall


def true_acc(P: float) -> np.ndarray:
    """The oracle's conditional acceptance at position k: 1 - (1 - P) / (7 - k)."""
    return 1.0 - (1.0 - P) / (GAMMA - np.arange(GAMMA))


class Fixed:
    def __init__(self, n):
        self.n = n


def run(cfg, machine, curve, draft, P, n_tokens, t0_ms, seed):
    """One generation of ``n_tokens``: (tokens, simulated ms).  ``cfg``: Fixed(n) or a policy."""
    rng = np.random.default_rng(seed)           # the machine's noise, per configuration alike
    orc = np.random.default_rng(seed + 7)       # the oracle's draws (one per cycle, as OracleProposer)
    now, toks = t0_ms, 0
    pol = cfg if isinstance(cfg, VerifyPolicy) else None
    while toks < n_tokens:
        err = GAMMA if orc.random() >= 1.0 - P else int(orc.integers(0, GAMMA))
        if pol is None:
            n = cfg.n
            ell = n
        elif pol.want_draft(1):
            n = pol.draft_length(1, GAMMA)
            ell = None
        else:
            n = 0
            ell = 0
        d_ms = machine.ms(rng, draft[n - 1], now) if n else 0.0
        now += d_ms
        if pol is not None and n:
            ell = pol.lengths([None], [n])[0]
            pol.observe_draft(1, d_ms, n)
        acc = min(ell, err)
        c_ms = machine.ms(rng, curve[ell] + INJECT_MS[ell > 0], now)
        now += c_ms
        if pol is not None:
            pol.update(ell, acc, None)
            pol.observe_cycle(1, ell + 1, c_ms)
        toks += acc + 1
    return toks, now - t0_ms


def make_auto(curve, draft, P, profile_speed, variant, prng):
    prof = [c * profile_speed * math.exp(0.03 * prng.standard_normal()) for c in curve]
    p = VerifyPolicy(mode="auto", cost=CostModel(prof, [draft[-1] * profile_speed]), gamma=GAMMA)
    if variant.startswith("auto "):   # auto with a policy field set (--set field=value)
        for kv in variant[5:].split(";"):
            k, v = kv.split("=")
            old = getattr(p, k, 0.0)
            setattr(p, k, v not in ("0", "False") if isinstance(old, bool) else type(old)(float(v)))
    if variant == "no explore":
        p.explore_band = 0.0
    if variant in ("true acc", "true both"):
        p._acc, p._n = true_acc(P), np.full(GAMMA, 1e12)
        p.update = lambda ell, acc, conf=None: None   # the truth, never revised
    if variant in ("true costs", "true both"):
        p.learn_costs = False   # the curve below, at the machine's speed of the moment (set per cycle)
    return p


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="docs/where_dspark_pays_17b_xeon_curve3.json")
    ap.add_argument("--p", default="0.3,0.5,0.7,0.8,0.9,0.95")
    ap.add_argument("--fixed", default="1,2,3,4,5,6,7")
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("-n", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--drift", type=float, default=0.1)
    ap.add_argument("--noise", type=float, default=0.08)
    ap.add_argument("--profile-speed", type=float, default=1.3)
    ap.add_argument("--set", action="append", default=[], help="field=value: a column of auto with that policy field set")
    a = ap.parse_args()
    res = json.load(open(a.json))[0]
    t1 = res["t1_ms"]
    curve = [t1 * r for r in res["curve"]]
    draft = res["draft_ms"]["1"]
    fixed = [int(x) for x in a.fixed.split(",")]
    variants = ["auto", "true costs", "true acc", "true both", "no explore"] + [f"auto {kv}" for kv in a.set]
    print(f"{res['target']}: t(1) = {t1:.1f} ms, draft pass n = 1..7: " + " ".join(f"{x:.0f}" for x in draft)
          + f" ms; drift {a.drift}, noise {a.noise}, profile read at {a.profile_speed}x; {a.samples} samples x "
          f"{a.n} tokens, {a.seeds} seeds")
    print("P | " + " | ".join(f"n={k}" for k in fixed) + " | " + " | ".join(variants) + " | auto/best")
    for P in [float(x) for x in a.p.split(",")]:
        table = {name: [] for name in [f"n={k}" for k in fixed] + variants}
        for seed in range(a.seeds):
            rng = np.random.default_rng(1000 + seed)
            machine = Machine(rng, a.drift, a.noise)
            autos = {v: make_auto(curve, draft, P, a.profile_speed, v, np.random.default_rng(seed)) for v in variants}
            ratios = {name: [] for name in table}
            t0 = 0.0
            for s in range(a.samples + 1):
                base = run(Fixed(0), machine, curve, draft, P, a.n, t0, 100 * s + seed)
                for v, pol in autos.items():
                    if v in ("true costs", "true both"):   # the truth at this moment
                        sp = machine.speed[min(int(t0 / 1e3), machine.speed.size - 1)]
                        pol.cost = CostModel([c * sp + INJECT_MS[k > 0] for k, c in enumerate(curve)],
                                             [draft[-1] * sp])
                        pol._draft_ms = {1: draft[-1] * sp}
                        pol._draft_ms_n = {(1, k + 1): x * sp for k, x in enumerate(draft)}
                        pol._restored_draft, pol._draft_passes = True, 2
                        pol._plans.clear()
                        pol._version += 1
                    tok, ms = run(pol, machine, curve, draft, P, a.n, t0, 100 * s + seed)
                    if s:   # sample 0 warms the policies (as the sweep does)
                        ratios[v].append((tok / ms) / (base[0] / base[1]))
                if s:
                    for k in fixed:
                        tok, ms = run(Fixed(k), machine, curve, draft, P, a.n, t0, 100 * s + seed)
                        ratios[f"n={k}"].append((tok / ms) / (base[0] / base[1]))
                t0 += 4 * base[1]   # the next sample starts later: the configurations take turns
            for name in table:
                table[name].append(float(np.median(ratios[name])))
        row = {name: float(np.mean(v)) for name, v in table.items()}
        best = max([1.0] + [row[f"n={k}"] for k in fixed])
        print(f"{P:.2f} | " + " | ".join(f"{row[name]:.3f}" for name in table) + f" | {row['auto'] / best:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
