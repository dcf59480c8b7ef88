"""Verification policy: how many of each request's drafted tokens to verify, and whether to draft.

Modes (``--schedule``):
  off        verify every drafted token (fixed block length, llama.cpp's default)
  static     cut at the first confidence below ``conf_min`` (llama.cpp's --spec-draft-p-min)
  survival   cut where the prefix survival prod(c) falls below ``p_survival_min``
  profiled   Algorithm 1 on the machine's profiled cost curve (draft cost included), and no draft
             pass at all while the running survival estimates say drafting cannot pay
  auto       (the default) profiled, with the running acceptance per position standing in for the
             confidences when the draft has no confidence head (DFlash, oracle, ...)

Every decision uses only what is known before the token it admits (confidences c_k depend on the
tokens before position k, the running estimates on past cycles), so every mode is lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import numpy as np

from pyllama_dspark.speculative import cycle_costs, heal, policy_memory, probes
from pyllama_dspark.speculative.cycle_costs import EXPLORE_SAMPLES
from pyllama_dspark.speculative.schedule import CostModel, apply_sts, schedule, static_cut, survival, survival_cut

MODES = ("off", "static", "survival", "profiled", "auto")
COST_MODES = ("profiled", "auto")
ACC_FLOOR = 1e-3
#: The share of a draft pass that does not shrink with a shorter block (graph build, per-pass
#: work); the rest is per drafted row.  Measured on this CPU (bench/where_dspark_pays.py prints the
#: pass per block size): a 1-draft pass of the shipped SmolLM2 drafter is 0.14 of a 7-draft pass
#: at R = 1 and 0.11 at R = 4, i.e. nearly linear.  Draft pass times are kept as full-block
#: equivalents through it.
DRAFT_FIXED_SHARE = 0.05
#: Optimism for what was seen only a few times: the plan (whether drafting pays, and the block)
#: reads the running acceptance at position k plus OPTIMISM * sqrt(max(a (1 - a), ACC_VAR_FLOOR) /
#: (n_k + 1)), n_k the verified tries at k (the verify schedule keeps the running estimate).  One
#: early rejection then cannot switch drafting off for a whole run (the probes that would correct it
#: are spaced by the probe budget), and positions a short block never reaches keep being tried
#: until known; with a memory of earlier runs (n_k large) the margin is gone.
OPTIMISM = 0.5
ACC_VAR_FLOOR = 0.05
#: Drafting must be planned to beat plain decoding by this share before it is switched on: the plan's
#: cycle costs and acceptance are measured to within a few percent, and a switch pays what the plan
#: leaves out (the draft catching up on the rows decoded plain, a cold pass, the batch's tail), so a
#: gain under the model's own error is not worth taking; given up, it costs at most this share.
DRAFT_MARGIN = 0.03
#: The plan's cost of a cycle it never ran is a guess: the one-sequence curve plus what the cycles it
#: did run cost over it.  With R = 4 sequences on SmolLM2 that guess was 0.79-1.45 of what such a
#: cycle measured, enough to pick blocks of 7 where blocks of 3 ran 1.1x faster.  So, while drafting,
#: a block the plan puts within EXPLORE_BAND of its best is tried until its cycle was measured
#: EXPLORE_SAMPLES times (its draft pass is measured with it), the most promising first; the plan
#: then reads what it measured.  The cost is bounded: a handful of cycles per block, kept in the
#: memory with the cycle costs, so a later process does not try them again.
EXPLORE_BAND = 0.15
#: While the plan says plain decoding wins, a moved cycle cost alone re-plans at most once in this
#: many cycles (a re-plan is ~0.4 ms of Python on a 2-core CPU, and jitter moved a plain cell every
#: ~12 cycles: ~30 us a cycle of host work in a run that drafts nothing).  What the drafts were
#: worth (acceptance, the draft pass, a probe's loss) re-plans at once, as before.
REPLAN_PLAIN_CYCLES = probes.REPLAN_PLAIN_CYCLES


@dataclass
class VerifyPolicy:
    mode: str = "off"
    conf_min: float = 0.0
    p_survival_min: float = 0.0
    cost: Optional[CostModel] = None
    temperatures: Optional[Sequence[float]] = None   # STS calibration (per position)
    gamma: int = 7
    ema: float = 0.1                                 # running conditional acceptance per position
    probe_every: int = 16                            # re-draft now and then when drafting was skipped
    probe_budget: float = 0.01                       # at most this share of the plain decoding time
    draft_margin: float = DRAFT_MARGIN               # the planned gain drafting needs over plain decoding
    explore_band: float = EXPLORE_BAND               # blocks planned this close to the best are tried
    probe_plan: bool = True                          # a probe runs the best drafting block (_probe_block)
    forget_cycles: float = 400.0                     # a cell not run drifts to its guess (cycle_costs)
    _acc: np.ndarray = field(default=None, repr=False)
    _skipped: int = 0
    _draft_ms: dict = field(default_factory=dict, repr=False)   # measured draft pass ms per R (EMA)
    _draft_ms_n: dict = field(default_factory=dict, repr=False)  # (R, n drafts) -> measured pass ms (EMA)
    _extra_ms: dict = field(default_factory=dict, repr=False)   # (R, drafted?) -> (cycle ms over the curve, samples)
    _extra_used: dict = field(default_factory=dict, repr=False)  # what the plan reads (moves in steps)
    _cycle_ms: dict = field(default_factory=dict, repr=False)   # (R, rows) -> (measured cycle ms, samples)
    _cycle_used: dict = field(default_factory=dict, repr=False)  # what the plan reads (moves in steps)
    _cycle_raw: dict = field(default_factory=dict, repr=False)   # (R, rows) -> first cycles of a drafting cell
    _cell_at: dict = field(default_factory=dict, repr=False)     # (R, rows) -> _cycles when last measured
    _costs: dict = field(default_factory=dict, repr=False)      # R -> (cost version, CostModel of R sequences)
    _cost_version: int = 0        # bumped when a cycle cost the plan reads moved (cost_for's cache)
    _n: np.ndarray = field(default=None, repr=False)            # verified tries per position
    _hit_sum: np.ndarray = field(default=None, repr=False)      # decayed sums for the online
    _conf_sum: np.ndarray = field(default=None, repr=False)     # confidence correction
    _probe_gap: int = 0
    learn_costs: bool = True      # follow the measured draft pass time (False: the cost model's, fixed)
    _cycles: int = 0
    _verified: int = 0
    _draft_cycles: int = 0
    _probing: bool = False        # this cycle's draft is a probe: it verifies at least one token
    _version: int = 0             # bumped whenever an input of want_draft's estimate changes
    _pays: dict = field(default_factory=dict, repr=False)   # R -> (version, does drafting pay)
    _cost_bumps: int = 0          # of _version's bumps, those from a moved cycle cost (cycle_costs.observe)
    _plain_plan: dict = field(default_factory=dict, repr=False)  # R -> (version less cost bumps, _cycles) of a plain plan
    _gaps: dict = field(default_factory=dict, repr=False)   # R -> (version, cycles between probes)
    _restored_draft: bool = False  # draft_ms came from an earlier process (its first pass here is cold)
    _draft_passes: int = 0         # draft passes timed in this process
    _cold_ms: Optional[float] = None  # a process's first pass over a warm one (kept in the memory)
    _probe_ms: dict = field(default_factory=dict, repr=False)  # first pass? -> (a probe's measured loss, n)
    _probe_now: Optional[list] = None  # the probe in flight: [first pass?, draft ms, tokens] (.probes)
    _plans: dict = field(default_factory=dict, repr=False)  # (R, n_max) -> (version, best, [(n, theta, rows)])
    _tried: dict = field(default_factory=dict, repr=False)  # (R, block) -> cycles it was tried to measure it
    _conf_seen: bool = False       # the proposals carry confidences (verification may go past the plan)
    memory_path: Optional[str] = field(default=None, repr=False)   # where .policy_memory keeps what it learned
    memory_about: Optional[dict] = field(default=None, repr=False)  # what that file is for (profile --show)
    profile_path: Optional[str] = field(default=None, repr=False)   # the cached curve this policy plans on
    profile_stale: Optional[str] = field(default=None, repr=False)  # why live cycles contradict it (.heal)
    _restored_cells: set = field(default_factory=set, repr=False)   # cycle cells from an earlier process (.heal)
    _heal: dict = field(default_factory=dict, repr=False)           # their samples here, and the draft's (.heal)
    _heal_probe: set = field(default_factory=set, repr=False)       # probe kinds whose loss was restored (.heal)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"schedule must be one of {MODES}, got {self.mode!r}")
        if self.mode in COST_MODES and self.cost is None:
            raise ValueError(f"the {self.mode} schedule needs a cost profile")
        if not 0.0 <= self.conf_min <= 1.0 or not 0.0 <= self.p_survival_min <= 1.0:
            raise ValueError("conf_min and p_survival_min must be in [0, 1]")
        if not 0.0 <= self.draft_margin < 1.0:
            raise ValueError("draft_margin must be in [0, 1)")
        if not 0.0 <= self.explore_band < 1.0:
            raise ValueError("explore_band must be in [0, 1)")
        # optimistic start: drafting is tried until evidence says it does not pay (the prior weighs
        # one observation, so a few cycles correct it)
        self._acc = np.full(self.gamma, 0.9)
        self._n = np.zeros(self.gamma)
        self._hit_sum = np.zeros(self.gamma)
        self._conf_sum = np.zeros(self.gamma)
        self._probe_gap = self.probe_every

    @property
    def needs_confidence(self) -> bool:
        return self.mode in ("static", "survival", "profiled")

    @property
    def uses_cost(self) -> bool:
        return self.mode in COST_MODES

    def calibrated(self, conf: np.ndarray) -> np.ndarray:
        c = np.asarray(conf, dtype=np.float64)
        if self.temperatures is None or c.size == 0:
            return c
        return apply_sts(c[None, :], self.temperatures)[0]

    def hopeful(self) -> np.ndarray:
        """The running acceptance per position plus the optimism margin of :data:`OPTIMISM`; a
        position never verified is planned no higher than the one before it.

        An untried position keeps the prior (0.9) and the largest margin, but it is reached only
        through the positions before it.  Read at its own hope, a drafter whose first draft is right
        30-45% of the time (the shipped drafter at T = 0.8) planned as a block of 7 surviving ~0.6
        at every depth (5.4 tokens a cycle, ~2.6 geometric), and a 7-draft pass with 8 verified rows
        (4-5 target steps on a 2-core CPU) was taken after a probe that hit.  Capped by the position
        before it, the plan is geometric from the last position seen; a verified position's own
        estimate rules."""
        a = self._acc
        h = np.minimum(1.0, a + OPTIMISM * np.sqrt(np.maximum(a * (1.0 - a), ACC_VAR_FLOOR) / (self._n + 1.0)))
        for k in np.flatnonzero(self._n[1:] <= 0) + 1:   # in order: a run of untried positions inherits
            h[k] = min(h[k], h[k - 1])
        return h

    # ---- draft cost ---------------------------------------------------------------------------
    def _drafts(self, n_draft: Optional[int]) -> int:
        """The drafts of a pass asked for ``n_draft`` (None: the full block), in 1..gamma."""
        return self.gamma if n_draft is None else max(1, min(int(n_draft), self.gamma))

    def block_factor(self, n_draft: Optional[int]) -> float:
        """A pass drafting ``n_draft`` tokens over a full block's pass."""
        nd = self._drafts(n_draft)
        if nd == self.gamma:
            return 1.0
        return DRAFT_FIXED_SHARE + (1.0 - DRAFT_FIXED_SHARE) * nd / self.gamma

    def observe_draft(self, n_requests: int, ms: float, n_draft: Optional[int] = None, caught_ms: float = 0.0) -> None:
        """A draft pass over ``n_requests`` blocks (of ``n_draft`` drafts; None: full) took ``ms``:
        the scheduler's estimate follows the proposer actually in use (a batched pass is not R
        single passes; an oracle costs ~0).  Kept as the full block's equivalent, less ``caught_ms``
        (after a process's first pass): the rows decoded plain since the last pass folded in, 40% of
        a 1.7B's pass after 7 plain cycles, which would keep drafting off after every probe."""
        if not self.learn_costs or n_requests <= 0 or not np.isfinite(ms) or ms < 0:
            return
        nd = self._drafts(n_draft)
        probes.drafted(self, ms)
        self._draft_passes += 1
        key = (n_requests, nd)
        if self._draft_passes == 1 and self._restored_draft:
            # the first pass of a process is cold (graph allocation, weights paged in, the prompt's
            # rows injected): with a figure learned by an earlier process, it is not what drafting
            # costs here, but what it costs over it is a process's first probe's (:meth:`_budget_gap`)
            self._observe_cold(ms - self.draft_estimate(n_requests, n_draft))
            heal.cold_pass(self, n_requests, ms / self.block_factor(n_draft), self.draft_estimate(n_requests))
            return
        raw = ms if self._draft_passes == 1 else max(0.0, ms - max(0.0, float(caught_ms)))
        ms = raw / self.block_factor(n_draft)
        old = self._draft_ms.get(n_requests)
        if self._draft_passes == 2 and not self._restored_draft:
            old = None   # the first, cold pass was a placeholder: the second one replaces it
            if key in self._draft_ms_n:
                self._observe_cold(self._draft_ms_n[key] - raw)
            self._draft_ms_n = {k: v for k, v in self._draft_ms_n.items() if k[0] != n_requests}
        self._draft_ms[n_requests] = ms if old is None else cycle_costs.log_step(old, ms, 0.2)
        # the pass of exactly this block size, as measured: a pass's cost is not linear in its rows
        # everywhere (kernels change with the batch), so a measured size beats the scaled estimate
        old_n = self._draft_ms_n.get(key)
        self._draft_ms_n[key] = raw if old_n is None else cycle_costs.log_step(old_n, raw, 0.2)
        heal.warm_pass(self, n_requests, ms)
        self._version += 1

    def _observe_cold(self, extra_ms: float) -> None:
        """What a process's first (cold) pass cost over a warm one: a running mean (rate 0.3)."""
        x = max(0.0, float(extra_ms))
        self._cold_ms = x if self._cold_ms is None else self._cold_ms + 0.3 * (x - self._cold_ms)

    def observe_cycle(self, n_requests: int, n_rows: int, ms: float) -> None:
        """A cycle of ``n_requests`` sequences decoded ``n_rows`` rows and, with accepting, injecting
        and rolling back, took ``ms`` (the draft pass not included).  Kept per (R, rows) as measured:
        the curve is measured on one sequence and without that work, which grows with the sequences
        and the accepted rows (R = 4 sequences of 4 rows each do not cost t(16)); and, for the row
        counts not run yet, what a cycle cost over the curve's t(n_rows), apart for cycles with
        drafts and without."""
        if not self.learn_costs or not self.uses_cost or n_requests <= 0 or n_rows < n_requests or \
                not np.isfinite(ms) or ms < 0:
            return
        probes.ended(self, n_requests, ms)
        cycle_costs.observe(self, n_requests, n_rows, ms)

    def extra_estimate(self, n_requests: int) -> tuple:
        """(plain, drafting) cycle ms over the curve for R sequences: both measured, else (0, 0)
        (one without the other would tilt the comparison by the difference it cannot see)."""
        plain, draft = self._extra_used.get((n_requests, False)), self._extra_used.get((n_requests, True))
        if plain is None or draft is None:
            return 0.0, 0.0
        return plain, draft

    def cost_for(self, n_requests: int) -> CostModel:
        """The cost curve of a cycle of R sequences: t(rows) as measured in this run (verify, accept,
        inject, roll back) where that many rows were run, else the profile's t(rows) plus what such
        cycles cost over it; the profile's own curve until both kinds of cycle are known."""
        r = max(1, n_requests)
        plain, draft = self.extra_estimate(r)
        if (plain, draft) == (0.0, 0.0):
            return self.cost
        hit = self._costs.get(r)   # rebuilt when a cycle cost moved, not on every acceptance update
        if hit is not None and hit[0] == self._cost_version:
            return hit[1]
        c = self.cost
        v = cycle_costs.planned_cycles(self, r, max(len(c.verify_ms), r * (self.gamma + 1)), plain, draft)
        model = CostModel(np.maximum(v, 1e-3), c.draft_ms, c.overhead_ms)
        self._costs[r] = (self._cost_version, model)
        return model

    def draft_estimate(self, n_requests: int, n_draft: Optional[int] = None) -> Optional[float]:
        """Measured draft pass ms for R blocks (scaled from the nearest measured R) of ``n_draft``
        drafts (None: the full block), or None (the profile's figure is used)."""
        if not self._draft_ms:
            return None
        nd = self._drafts(n_draft)
        if (n_requests, nd) in self._draft_ms_n:
            return self._draft_ms_n[(n_requests, nd)]
        if n_requests in self._draft_ms:
            full = self._draft_ms[n_requests]
        else:
            near = min(self._draft_ms, key=lambda r: abs(r - n_requests))
            full = self._draft_ms[near] * n_requests / near
        return full * self.block_factor(n_draft)

    def _plan(self, n_requests: int, n_max: int):
        """(block, throughput): the draft block n <= n_max whose expected schedule (running
        acceptance, the cost curve, the pass of an n-draft block) gives the most tokens per second,
        and that throughput; block 0 when plain decoding wins.  Past statistics only."""
        return self._planned(n_requests, n_max)[0]

    def _planned(self, n_requests: int, n_max: int):
        """(the plan, [(block, its throughput, its rows) for every block]), cached per version."""
        r, n_max = max(1, n_requests), max(1, min(int(n_max), self.gamma))
        hit = self._plans.get((r, n_max))
        if hit is not None and hit[0] == self._version:
            return hit[1:]
        c = self.cost_for(r)
        best = (0, r / ((c.t_verify(r) + c.overhead_ms) / 1e3))
        surv = survival(self.hopeful()[:n_max])
        known = self.draft_estimate(r) is not None
        blocks = []
        for n in range(1, n_max + 1):
            dms = self.draft_estimate(r, n) if known else c.t_draft(r) * self.block_factor(n)
            sc = schedule([surv[:n]] * r, c, drafted=True, draft_ms=dms)
            th = sc.throughput
            blocks.append((n, th, sc.batch))
            # drafting must beat plain decoding by the margin; near-ties (0.5%) go to the longer block
            if (th > best[1] * (1.0 + self.draft_margin)) if best[0] == 0 else (th >= best[1] * 0.995):
                best = (n, max(th, best[1]) if best[0] else th)
        self._plans[(r, n_max)] = (self._version, best, blocks)
        return best, blocks

    def _explore(self, n_requests: int, n_max: int, n: int) -> int:
        """The block to draft while drafting pays: the plan's ``n``, or a block planned within
        explore_band of it whose cycle cost is still the curve's guess (see EXPLORE_BAND)."""
        r = max(1, n_requests)
        if not self.learn_costs or self.explore_band <= 0 or self.cost_for(r) is self.cost:
            return n   # nothing measured at R yet: every block is the curve's guess alike
        (_, top), blocks = self._planned(r, n_max)
        own = blocks[n - 1][2]   # the rows the plan verifies: measured by running it
        for m, th, rows in sorted(blocks, key=lambda b: -b[1]):
            tried = self._tried.get((r, m), 0)
            # tries are capped too: a cycle need not run the rows planned (a sequence near its end)
            if rows != own and th >= (1.0 - self.explore_band) * top and tried < 2 * EXPLORE_SAMPLES and \
                    self._cycle_ms.get((r, rows), (None, 0))[1] < EXPLORE_SAMPLES:
                self._tried[(r, m)] = tried + 1
                return m
        return n

    def draft_length(self, n_requests: int, n_max: int) -> int:
        """How many drafts to ask the drafter for this step: the cost-driven modes ask for the
        planned block (a shorter block is a cheaper pass), one more when confidences may let the
        verification go past it, the probe's block on a probe; the others always ``n_max``."""
        if not self.uses_cost or n_max <= 1:
            return n_max
        if self._probing:
            probe = self._probe_block(n_requests, n_max)
            return n_max if probe is None else probe[0]
        n = self._plan(n_requests, n_max)[0]
        if n == 0:
            return n_max   # a pass forced to learn the draft's cost: the full block
        n = self._explore(n_requests, n_max, n)
        return min(n_max, n + 1 if self._conf_seen else n)

    # ---- before drafting ----------------------------------------------------------------------
    def want_draft(self, n_requests: int) -> bool:
        self._probing, self._probe_now = False, None
        if not self.uses_cost:
            return True
        if self.learn_costs and not self._restored_draft and self._draft_passes < 2:
            # two passes to learn what drafting costs here (the first of a process is cold)
            return True
        r = max(1, n_requests)
        if self.learn_costs and (r, True) in self._extra_ms and (r, False) not in self._extra_ms:
            # drafting cycles of R sequences measured, a plain one never: the plan reads the measured
            # cycle costs only once both kinds are known, so one plain cycle is run to know it (else
            # while auto drafts from the start, at R = 4 say, it would plan on the curve for good)
            return False
        if self._pays_now(r):
            self._skipped = 0
            self._probe_gap = self.probe_every
            return True
        self._skipped += 1
        # a probe now and then keeps the estimates alive (_probe_block), backing off while probes say
        # drafting does not pay, within probe_budget of the plain decoding time
        if self.probe_every and self._skipped >= max(self._probe_gap, self._budget_gap(n_requests)):
            self._skipped = 0
            self._probe_gap = min(2 * self._probe_gap, 16 * self.probe_every)
            self._probing = True
            probes.begin(self)
            return True
        return False

    def _probe_block(self, n_requests: int, n_max: int):
        """(block, ms it is planned to lose) of a probe, or None (:func:`.probes.probe_block`)."""
        return probes.probe_block(self, n_requests, n_max)

    def _budget_gap(self, n_requests: int) -> int:
        """Plain cycles between probes (:func:`.probes.budget_gap`)."""
        return probes.budget_gap(self, n_requests)

    def _pays_now(self, n_requests: int) -> bool:
        """Algorithm 1 on the running estimates, recomputed only when they changed (a cycle that
        verified nothing leaves them as they were: not drafting costs no scheduling either)."""
        hit = self._pays.get(n_requests)
        if hit is not None and hit[0] == self._version:
            return hit[1]
        learned = self._version - self._cost_bumps
        if hit is not None and not hit[1]:
            held = self._plain_plan.get(n_requests)
            if held is not None and held[0] == learned and self._cycles - held[1] < REPLAN_PLAIN_CYCLES:
                return False   # only a cycle cost moved since plain decoding was planned, and lately
        pays = self._plan(n_requests, self.gamma)[0] > 0
        self._pays[n_requests] = (self._version, pays)
        if not pays:
            self._plain_plan[n_requests] = (learned, self._cycles)
        return pays

    # ---- after drafting -------------------------------------------------------------------------
    def lengths(self, confs: Sequence[Optional[np.ndarray]], n_drafted: Sequence[int]) -> List[int]:
        """Verify lengths per request from the (raw) confidences of its drafted tokens."""
        probing, self._probing = self._probing, False
        if self.mode == "off" or not any(n_drafted):
            return list(n_drafted)
        out = []
        if self.mode in ("static", "survival"):
            for c, n in zip(confs, n_drafted):
                if n == 0:
                    out.append(0)
                    continue
                if c is None:
                    raise ValueError(f"the {self.mode} schedule needs a draft with a confidence head")
                c = self.calibrated(c[:n])
                out.append(static_cut(c, self.conf_min) if self.mode == "static" else
                           survival_cut(c, self.p_survival_min))
            return out
        surv = []
        for c, n in zip(confs, n_drafted):
            if n == 0:
                surv.append(np.zeros(0))
                continue
            if c is None:
                if self.mode != "auto":
                    raise ValueError("the profiled schedule needs a draft with a confidence head")
                # no confidence head: the running conditional acceptance per position (past cycles)
                acc = np.concatenate([self._acc, np.full(max(0, n - self.gamma), self._acc[-1])])[:n]
                surv.append(survival(acc))
                continue
            self._conf_seen = True
            surv.append(survival(self.corrected(self.calibrated(c[:n]))))
        n_blocks = sum(1 for n in n_drafted if n > 0)
        out = schedule(surv, self.cost_for(len(confs)), drafted=True, draft_ms=self.draft_estimate(n_blocks)).lengths
        if probing:   # all of the probe's block (_probe_block); a probe verifying nothing learns nothing
            full = self.probe_plan and self.draft_estimate(n_blocks) is not None
            out = list(n_drafted) if full else [max(1, ell) if n else 0 for ell, n in zip(out, n_drafted)]
        return list(out)

    def corrected(self, conf: np.ndarray) -> np.ndarray:
        """Profiled mode: confidences rescaled per position by the observed acceptance over the
        confidence the verified positions had (decayed sums, one pseudo-observation each), so an
        uncalibrated draft head cannot keep the scheduler over-admitting.  Uses past cycles only."""
        c = np.asarray(conf, dtype=np.float64)
        if not self.uses_cost or c.size == 0:
            return c
        k = min(c.size, self.gamma)
        ratio = (self._hit_sum[:k] + 1.0) / (self._conf_sum[:k] + 1.0)
        out = c.copy()
        out[:k] = np.clip(c[:k] * ratio, 0.0, 1.0)
        return out

    def update(self, n_verified: int, n_accepted: int, conf: Optional[np.ndarray] = None) -> None:
        """Running conditional acceptance per position from one verified block; ``conf``: the
        (calibrated) confidences the verified drafts had, for :meth:`corrected`."""
        self._cycles += 1
        probes.accepted(self, n_accepted)
        self._verified += n_verified
        self._draft_cycles += 1 if n_verified else 0
        c = None if conf is None else self.calibrated(np.asarray(conf[:n_verified], dtype=np.float64))
        for k in range(min(n_verified, self.gamma)):
            if k > n_accepted:
                break
            hit = 1.0 if k < n_accepted else 0.0
            self._version += 1
            self._n[k] += 1
            rate = max(self.ema, 1.0 / (self._n[k] + 1.0))
            # floored: an estimate at exactly 0 could never be revised by a schedule that only
            # verifies what might pay (probes still test it)
            self._acc[k] = max(ACC_FLOOR, self._acc[k] + rate * (hit - self._acc[k]))
            if c is not None and k < c.size:
                self._hit_sum[k] = 0.97 * self._hit_sum[k] + hit
                self._conf_sum[k] = 0.97 * self._conf_sum[k] + c[k]

    # ---- what it learned, across processes (see .policy_memory) -----------------------------
    def learned(self) -> dict:
        """What the running estimates hold, JSON-able (:func:`.policy_memory.state_of`)."""
        return policy_memory.state_of(self)

    def restore(self, state: dict) -> bool:
        """Start from what an earlier process learned (:meth:`learned`) instead of the optimistic
        prior; False (nothing changed) when it does not fit this policy."""
        return policy_memory.load_state(self, state, ACC_FLOOR)

    # ---- telling the user ---------------------------------------------------------------------
    def summary(self, verify_lengths: Optional[Sequence[int]] = None) -> str:
        """One line on what the schedule chose, and why, for the stats line: over the given verify
        lengths (one generation's), else over every cycle this policy has seen."""
        if verify_lengths is None:
            cycles, verified, drafting = self._cycles, self._verified, self._draft_cycles
        else:
            cycles, verified = len(verify_lengths), int(sum(verify_lengths))
            drafting = sum(1 for v in verify_lengths if v)
        if self.mode == "off":
            return "schedule off: every drafted token verified (llama.cpp's fixed block)"
        per = verified / max(cycles, 1)
        line = f"schedule {self.mode}: verified {per:.2f} drafts/cycle ({drafting} of {cycles} cycles verified drafts)"
        if self.uses_cost and cycles and per < 0.5:
            c = self.cost
            steps = c.t_verify(1 + self.gamma) / c.t_verify(1)
            draft = self.draft_estimate(1)
            draft = c.t_draft(1) if draft is None else draft
            line += (f": on this machine verifying {self.gamma} drafts costs {steps:.1f} target steps and a draft pass "
                     f"{draft / c.t_verify(1):.1f}, and the draft's acceptance does not cover it "
                     f"(--schedule off forces the fixed block)")
        return line

