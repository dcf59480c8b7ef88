"""Cost profile of this machine: target decode time per verify batch B, draft block cost, overhead.

``measure()`` runs real decodes (interleaved: every repeat visits B = 1..B_max in a fresh shuffled
order, so machine noise spreads over all B) and reports the median and the p10-p90 spread; the
result is cached as JSON keyed by the model files, n_ctx, threads, flash attention and offload, and
turned into a :class:`~pyllama_dspark.speculative.schedule.CostModel` for the scheduler.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

import numpy as np

from pyllama_dspark.llama.recurrent import Checkpoint
from pyllama_dspark.speculative import profile_check
from pyllama_dspark.speculative.schedule import CostModel

log = logging.getLogger(__name__)

#: 2: the auto curve reads the sizes one sequence verifies (B <= FOCUS_B) at least FOCUS_READINGS
#: times; a version 1 file may hold one reading per size, and is measured again.  3: a profile
#: records its readings per size, when and under which load it was measured and which versions made
#: it (:mod:`.profile_check`); a version 2 file says none of that, and is measured again
PROFILE_VERSION = 3
#: The verify sizes of one sequence's blocks (up to 7 drafts and the anchor).  A large target's curve
#: fits one round of B = 1..32 in the budget, and one reading per size left jags the cycles never
#: showed (a 1.7B on a 2-core Xeon: t(4) read 0.80 of t(3), measured as cycles 1.40 of it); so the
#: auto curve reads these sizes at least FOCUS_READINGS times, a median of them.
FOCUS_B = 8
FOCUS_READINGS = 3


@dataclass
class Profile:
    key: str
    settings: dict
    batch_sizes: List[int]
    verify_ms: List[float]          # median per B
    verify_p10: List[float]
    verify_p90: List[float]
    draft_ms: float                 # one draft block pass (median), 0 without a draft
    draft_spread: List[float] = field(default_factory=lambda: [0.0, 0.0])
    overhead_ms: float = 0.0        # Python + inject per cycle
    repeats: int = 0
    version: int = PROFILE_VERSION
    # costs given rather than measured (e.g. a test's): the policy keeps draft_ms instead of
    # learning the draft pass time from the clock, so its decisions are deterministic
    fixed: bool = False
    readings: List[int] = field(default_factory=list)   # decodes timed per B
    measured_at: float = 0.0                             # unix time
    load: dict = field(default_factory=dict)             # profile_check.LoadWatch while it was measured
    made_by: dict = field(default_factory=dict)          # profile_check.made_by()

    def cost_model(self) -> CostModel:
        return CostModel(self.verify_ms, draft_ms=[self.draft_ms], overhead_ms=self.overhead_ms)

    def table(self) -> str:
        lines = [f"{'B':>3} {'ms median':>10} {'p10':>8} {'p90':>8} {'steps/s':>8} {'ms/token':>9}"]
        for b, m, lo, hi in zip(self.batch_sizes, self.verify_ms, self.verify_p10, self.verify_p90):
            lines.append(f"{b:>3} {m:>10.2f} {lo:>8.2f} {hi:>8.2f} {1e3 / m:>8.1f} {m / b:>9.2f}")
        lines.append(f"draft block {self.draft_ms:.2f} ms (p10-p90 {self.draft_spread[0]:.2f}-{self.draft_spread[1]:.2f}), "
                     f"overhead {self.overhead_ms:.3f} ms/cycle, {self.repeats} repeats")
        return "\n".join(lines)


def _file_id(path: Optional[str]) -> str:
    if not path:
        return "-"
    st = os.stat(path)
    return f"{os.path.realpath(path)}:{st.st_size}:{int(st.st_mtime)}"


def profile_key(target: str, draft: Optional[str], n_ctx: int, n_threads: int, flash_attn: str,
                n_gpu_layers, b_max: int, n_rs_seq: int = 0) -> str:
    fields = [PROFILE_VERSION, _file_id(target), _file_id(draft), n_ctx, n_threads, flash_attn, n_gpu_layers, b_max]
    if n_rs_seq:   # a hybrid's decodes also write n_rs_seq recurrent-state snapshots: another curve
        fields.append(["n_rs_seq", int(n_rs_seq)])
    raw = json.dumps(fields)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def default_path(key: str) -> Path:
    from pyllama_dspark.paths import cache_dir

    d = cache_dir() / "profiles"
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{key}.json"


def load(path) -> Profile:
    data = json.loads(Path(path).read_text())
    if data.get("version") != PROFILE_VERSION:
        raise ValueError(f"{path}: profile version {data.get('version')} != {PROFILE_VERSION}")
    return Profile(**data)


def save(profile: Profile, path) -> None:
    p = Path(path)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(profile), indent=1))
    os.replace(tmp, p)


def _verify_curve(tgt, b_max: int, repeats: int, budget_s: float, seed: int, progress, on_prefill=None,
                  after_round=None, focus: int = 0):
    """Target decode ms per verify batch B = 1..b_max after a short prompt on sequence 0: rounds
    over every B in a fresh shuffled order (machine noise spreads over all B), at most ``repeats``
    of them; after the first round, stops once ``budget_s`` is spent.  With ``focus``, the sizes
    B <= focus also get a round of their own between the whole rounds, and are read at least
    FOCUS_READINGS times even past the budget (only they are decoded then).  Returns (times per B,
    whole rounds, the prompt)."""
    rng = np.random.default_rng(seed)
    prompt = np.asarray(tgt.tokenize("The quick brown fox jumps over the lazy dog. " * 6), dtype=np.int32)
    prompt = prompt[: max(1, min(len(prompt), tgt.n_ctx - b_max - 1, tgt.n_batch))]   # one decode
    n0 = len(prompt)
    tgt.seq_rm(0, 0, -1)
    tgt.decode(prompt, 0, all_outputs=False)
    if on_prefill is not None:
        on_prefill(prompt)
    # a recurrent state (hybrid targets) cannot be cut B positions back: restored after each decode
    ckpt = Checkpoint(tgt, 0) if getattr(tgt, "recurrent", False) else None
    toks = rng.integers(100, min(tgt.n_vocab, 20000), size=b_max).astype(np.int32)
    ids = np.zeros(b_max, dtype=np.int32)
    margin = np.zeros(b_max, dtype=np.float32)
    times = {b: [] for b in range(1, b_max + 1)}
    focus = max(0, min(int(focus), b_max))
    short = lambda b: b <= focus and len(times[b]) < FOCUS_READINGS  # noqa: E731
    t_start = time.perf_counter()
    done = r = rounds = 0
    while r < repeats:
        whole = not 0 < focus < b_max or rounds % 2 == 0   # between whole rounds, one over B <= focus
        for b in rng.permutation(np.arange(1, (b_max if whole else focus) + 1)):
            if rounds >= 1 and time.perf_counter() - t_start > budget_s:
                if not any(short(k) for k in times):
                    return times, r, prompt
                if not short(b):
                    continue   # past the budget: only the focus sizes still short of readings
            t0 = time.perf_counter()
            tgt.decode(toks[:b], n0, all_outputs=True)
            tgt.argmax(0, int(b), ids, margin)
            times[int(b)].append((time.perf_counter() - t0) * 1e3)
            if ckpt is not None:
                ckpt.restore(tgt, 0)
            tgt.seq_rm(0, n0, -1)
            done += 1
            if progress:
                progress(done, repeats * b_max)
        rounds += 1
        r += whole
        if after_round is not None and whole:
            after_round()
    return times, r, prompt


def measure(sp, *, b_max: int = 32, repeats: int = 5, seed: int = 0,
            progress: Optional[Callable[[int, int], None]] = None) -> Profile:
    """Profile an open :class:`~pyllama_dspark.decode.api.Speculator` (target, optional draft)."""
    from pyllama_dspark.speculative.drafter import DraftModelProposer

    if b_max < 1 or repeats < 1:
        raise ValueError("b_max and repeats must be >= 1")
    tgt = sp.target
    if b_max > tgt.n_batch:
        raise ValueError(f"b_max {b_max} exceeds n_batch {tgt.n_batch}")
    draft_times: List[float] = []
    prop = sp.proposer if isinstance(sp.proposer, DraftModelProposer) else None
    state = {}

    def prefill(prompt):
        state["n0"], state["anchor"] = len(prompt), int(prompt[-1])
        if prop is not None:
            prop.reset()
            prop.observe(0, len(prompt), 0)

    def draft_round():
        if prop is not None:
            t0 = time.perf_counter()
            prop.propose(int(state["anchor"]), state["n0"], prop.max_draft())
            draft_times.append((time.perf_counter() - t0) * 1e3)

    watch = profile_check.LoadWatch()
    times, _, prompt = _verify_curve(tgt, b_max, repeats, float("inf"), seed, progress, prefill, draft_round)
    load = watch.stop()
    # per-cycle overhead: a short real generation
    overhead = 0.0
    done_gen = sp.generate(prompt.tolist(), 24, ignore_eos=True)
    st = done_gen.stats
    if st.cycles:
        overhead = (st.ms_overhead + st.ms_inject) / st.cycles
    s = sp.target.settings   # as loaded: n_gpu_layers resolved
    key = profile_key(tgt.path, getattr(sp.draft, "path", None), s.n_ctx, s.n_threads or 0, s.flash_attn,
                      s.placement(), b_max)
    bs = list(range(1, b_max + 1))
    q = lambda b, p: float(np.percentile(times[b], p))  # noqa: E731
    return Profile(
        key=key,
        settings=dict(target=tgt.path, draft=getattr(sp.draft, "path", None), n_ctx=s.n_ctx, n_threads=s.n_threads,
                      flash_attn=s.flash_attn, n_gpu_layers=s.placement(), b_max=b_max),
        batch_sizes=bs, verify_ms=[q(b, 50) for b in bs], verify_p10=[q(b, 10) for b in bs],
        verify_p90=[q(b, 90) for b in bs],
        draft_ms=float(np.median(draft_times)) if draft_times else 0.0,
        draft_spread=[float(np.percentile(draft_times, 10)), float(np.percentile(draft_times, 90))] if draft_times else [0.0, 0.0],
        overhead_ms=overhead, repeats=repeats, **_provenance(times, bs, load))


def _provenance(times, bs, load) -> dict:
    return dict(readings=[len(times[b]) for b in bs], measured_at=round(time.time(), 1), load=load,
                made_by=profile_check.made_by())


def load_or_measure(sp, *, path=None, b_max: int = 32, repeats: int = 5, remeasure: bool = False,
                    progress=None) -> Profile:
    """The cached profile for these settings, measuring it on first use."""
    s = sp.target.settings   # as loaded: n_gpu_layers resolved
    key = profile_key(sp.target.path, getattr(sp.draft, "path", None), s.n_ctx, s.n_threads or 0, s.flash_attn,
                      s.placement(), b_max)
    p = Path(path) if path else default_path(key)
    if p.exists() and not remeasure:
        try:
            prof = load(p)
        except (ValueError, TypeError):   # another profile version, or a damaged file: measure again
            prof = None
        if prof is not None and (prof.key == key or path):
            return prof
    prof = measure(sp, b_max=b_max, repeats=repeats, progress=progress)
    save(prof, p)
    return prof


# ---- the automatic schedule's cost curve ---------------------------------------------------------

#: A cost profile file used for every target instead of the cache / a measurement (tests, or a
#: curve measured elsewhere).
PROFILE_ENV = "PYLLAMA_DSPARK_COST_PROFILE"
AUTO_B_MAX = 32
AUTO_BUDGET_S = 15.0


def measure_target(target, *, b_max: int = AUTO_B_MAX, repeats: int = 5, budget_s: float = AUTO_BUDGET_S,
                   seed: int = 0, progress: Optional[Callable[[int, int], None]] = None) -> Profile:
    """The target's verify cost curve alone (B = 1..b_max, interleaved rounds: one whole, then
    more while within ``budget_s``; B <= FOCUS_B read at least FOCUS_READINGS times).  The draft
    pass cost is left to the policy, which measures the draft actually in use on its first block.
    Uses (and clears) sequence 0 of the target."""
    b_max = max(1, min(b_max, target.n_batch))
    watch = profile_check.LoadWatch()
    try:
        times, r, _ = _verify_curve(target, b_max, repeats, budget_s, seed, progress, focus=FOCUS_B)
    finally:
        target.seq_rm(0, 0, -1)
    load = watch.stop()
    s = target.settings
    bs = list(range(1, b_max + 1))
    q = lambda b, p: float(np.percentile(times[b], p))  # noqa: E731
    return Profile(
        key=target_key(target), settings=dict(target=target.path, draft=None, n_ctx=s.n_ctx, n_threads=s.n_threads,
                                              flash_attn=s.flash_attn, n_gpu_layers=s.placement(), b_max=b_max),
        batch_sizes=bs, verify_ms=[q(b, 50) for b in bs], verify_p10=[q(b, 10) for b in bs],
        verify_p90=[q(b, 90) for b in bs], draft_ms=0.0, overhead_ms=0.0, repeats=r, **_provenance(times, bs, load))


def target_key(target) -> str:
    s = target.settings
    return profile_key(target.path, None, s.n_ctx, s.n_threads or 0, s.flash_attn, s.placement(),
                       min(AUTO_B_MAX, target.n_batch), getattr(target, "n_rs_seq", 0))


def _cached(target):
    """(the cached auto curve for this target and settings, or None; why a cached one is not used)."""
    key = target_key(target)
    path = default_path(key)
    if not path.exists():
        return None, []
    try:
        prof = load(path)
    except (ValueError, TypeError, json.JSONDecodeError) as e:
        return None, [f"unreadable ({str(e)[:80]})"]
    if prof.key != key:
        return None, ["made for other settings"]
    why = profile_check.stale(prof.made_by) + problems(prof)
    return (None, why) if why else (prof, [])


def known_profile(target) -> Optional[Profile]:
    """The profile :func:`auto_profile` returns without measuring ($PYLLAMA_DSPARK_COST_PROFILE or
    the cached one for this target and settings, if it passes :func:`problems` and was made by this
    install), or None when it would have to measure."""
    env = os.environ.get(PROFILE_ENV)
    if env:
        return load(env)
    return _cached(target)[0]


def _notices(echo, progress: bool):
    """(say, warn): where the measuring notice and the rejections go: ``echo`` when given; else
    stderr with a progress bar, or without one (a library caller asked for quiet) this module's
    logger (INFO / WARNING: Python prints warnings on stderr unless logging is configured)."""
    if echo is not None:
        return echo, echo
    if progress:
        out = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
        return out, out
    return log.info, log.warning


def auto_profile(target, echo: Optional[Callable[[str], None]] = None, progress: bool = True) -> Profile:
    """The cost profile the automatic schedule uses for this target and settings: the file in
    $PYLLAMA_DSPARK_COST_PROFILE, else the cached one, else measured now (<= ~20 s, a progress bar
    on stderr unless ``progress`` is False) and cached when :func:`problems` finds nothing wrong
    with it (else measured once more, and a second rejected curve is used for this run only)."""
    env = os.environ.get(PROFILE_ENV)
    if env:
        return load(env)
    prof, why = _cached(target)
    if prof is not None:
        return prof
    path = default_path(target_key(target))
    say, warn = _notices(echo, progress)
    if why:
        warn(f"pyllama-dspark: the cached verify cost curve ({path}) is not used: {'; '.join(why)}")
    say(f"pyllama-dspark: measuring this machine's verify cost curve for "
        f"{os.path.basename(target.path or '?')} (target decodes of 1..{min(AUTO_B_MAX, target.n_batch)} rows, "
        f"once; cached in {path})")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc="cost profile", unit="decode", leave=False, file=sys.stderr)

        def tick(done, total):
            bar.total = total
            bar.update(done - bar.n)
    prof = measure_target(target, progress=tick if bar is not None else None)
    if not plausible(prof):
        # a busy machine (llama.cpp's threads spin-wait behind other processes) makes every decode
        # wait alike: cached, that curve would steer every later run
        warn(f"pyllama-dspark: the measured verify cost curve is rejected ({'; '.join(problems(prof)) or 'implausible'}); "
             f"measuring once more")
        prof = measure_target(target, progress=tick if bar is not None else None)
    if bar is not None:
        bar.close()
    if plausible(prof):
        save(prof, path)
    else:
        warn(f"pyllama-dspark: the verify cost curve is rejected again ({'; '.join(problems(prof)) or 'implausible'}): "
             f"used for this run only, not cached (measure on an idle machine)")
    return prof


def problems(prof: Profile) -> List[str]:
    """Why a measured curve cannot be cached (:mod:`.profile_check`): contention while it was
    measured; on a CPU, a shape no quiet machine gives (flat, a size out of line, superlinear) or
    a spread that is mostly noise.  A curve given rather than measured (``fixed``) is taken as is."""
    if prof.fixed:
        return []
    threads = int(prof.settings.get("n_threads") or 0)
    if threads <= 0:
        from pyllama_dspark.llama.settings import default_threads

        threads = default_threads()
    out = profile_check.contention(prof.load or {}, threads)
    ngl = prof.settings.get("n_gpu_layers")
    if int((ngl[0] if isinstance(ngl, list) else ngl) or 0) > 0:
        return out   # GPU curves can be flat and jitter on their own
    return out + profile_check.shape(prof.verify_ms, prof.verify_p10, prof.verify_p90, prof.readings)


def plausible(prof: Profile) -> bool:
    """Whether a measured curve can be cached: :func:`problems` finds nothing."""
    return not problems(prof)


def save_for_auto(prof: Profile, target) -> Optional[Path]:
    """Also keep a full profile's verify curve (``pyllama-dspark profile``, measured with a draft)
    where the automatic schedule reads its curve for this target and settings (the draft pass is
    left to the policy, which measures the draft in use); None when the profile's sizes do not
    reach auto's or it has problems."""
    b = min(AUTO_B_MAX, target.n_batch)
    if len(prof.verify_ms) < b or not plausible(prof):
        return None
    s = dict(prof.settings, draft=None, b_max=b)
    auto = Profile(**dict(asdict(prof), key=target_key(target), settings=s, verify_ms=prof.verify_ms[:b],
                          verify_p10=prof.verify_p10[:b], verify_p90=prof.verify_p90[:b], batch_sizes=prof.batch_sizes[:b],
                          readings=list(prof.readings[:b]), draft_ms=0.0, draft_spread=[0.0, 0.0], overhead_ms=0.0))
    path = default_path(auto.key)
    save(auto, path)
    return path


def forget(path, why: str) -> bool:
    """Remove a cached curve that live cycles contradicted (the next process measures it again; a
    running one never does): True when there was one.  Says why through the logger."""
    try:
        os.unlink(path)
    except OSError:
        return False
    log.warning("pyllama-dspark: the cached verify cost curve %s is dropped: %s; the next run measures it again",
                path, why)
    return True
