"""The one policy factory: a front end's schedule options -> the VerifyPolicy of an open target.

Every front end (``run``, ``serve``, ``bench``, ``bench-schedule``, :class:`~pyllama_dspark.decode.api.Speculator`,
the ``Llama`` plug-in and the ``DSpark`` class) calls :func:`make_policy`; they differ only in
where their options come from.  The policy itself is built by :func:`policy_for`; the rest of this
module finds what it needs: the cost curve (the cached auto curve, a profile file, or a full
profile measured with the draft), the calibration file, whether the proposer reports confidences,
and what an earlier process learned (:mod:`.policy_memory`).
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

from pyllama_dspark.speculative import costprofile, policy_memory
from pyllama_dspark.speculative.policy import COST_MODES, MODES, VerifyPolicy


def policy_for(mode: Optional[str], *, has_draft: bool, has_confidence: bool, cost_source=None,
               conf_min: Optional[float] = None, p_survival_min: Optional[float] = None,
               temperatures: Optional[Sequence[float]] = None, gamma: int = 7) -> Optional[VerifyPolicy]:
    """The one constructor of a verification policy from user input, for every front end.

    ``mode`` None picks ``static`` / ``survival`` when their threshold is given, else ``auto``.
    Returns None (plain fixed-length verification) for ``off`` and when there is no draft.
    ``cost_source``: a :class:`~.schedule.CostModel`, a :class:`~.costprofile.Profile`, or a
    callable returning either (called only when a cost-driven mode needs it: measuring is slow)."""
    mode = pick_mode(mode, conf_min, p_survival_min)
    if mode not in MODES:
        raise ValueError(f"schedule must be one of {MODES}, got {mode!r}")
    if mode == "off" or not has_draft:
        if mode in ("static", "survival", "profiled") and not has_draft:
            raise ValueError(f"the {mode} schedule needs a draft")
        return None
    if mode in ("static", "survival", "profiled") and not has_confidence:
        raise ValueError(f"the {mode} schedule needs a draft with a confidence head (use auto or off)")
    if mode == "static" and conf_min is None:
        raise ValueError("the static schedule needs conf_min")
    if mode == "survival" and p_survival_min is None:
        raise ValueError("the survival schedule needs p_survival_min")
    cost, learn = None, True
    if mode in COST_MODES:
        src = cost_source() if callable(cost_source) else cost_source
        if src is None:
            raise ValueError(f"the {mode} schedule needs a cost profile")
        if hasattr(src, "cost_model"):
            learn = not getattr(src, "fixed", False)
            src = src.cost_model()
        cost = src
    return VerifyPolicy(mode=mode, conf_min=conf_min or 0.0, p_survival_min=p_survival_min or 0.0, cost=cost,
                        temperatures=temperatures, gamma=gamma, learn_costs=learn)


def pick_mode(schedule: Optional[str], conf_min: Optional[float] = None,
              p_survival_min: Optional[float] = None) -> str:
    """``--schedule`` as given, else static / survival when their threshold is given, else auto."""
    if schedule is not None:
        return schedule
    return "static" if conf_min is not None else "survival" if p_survival_min is not None else "auto"


def proposer_confidence(proposer, draft) -> bool:
    """Whether the proposals carry confidences: a proposer says so (``has_confidence``; the
    user-facing oracle reports none), else the draft's confidence head."""
    flag = getattr(proposer, "has_confidence", None)
    if flag is not None:
        return bool(flag)
    return draft is not None and bool(draft.meta.has_confidence)


def proposer_tag(proposer, draft) -> str:
    """What the memory of learned acceptance is kept per: the proposer kind and its setting."""
    tag = getattr(proposer, "memory_tag", None)
    if tag:
        return str(tag)
    return getattr(proposer, "name", None) or (draft.meta.kind if draft is not None else "none")


def make_policy(target, draft, schedule=None, *, proposer=None, cost_profile=None,
                conf_min: Optional[float] = None, p_survival_min: Optional[float] = None,
                calibration: Optional[str] = None, gamma: int = 7, on_measured: Optional[Callable[[], None]] = None,
                measure_full: Optional[Callable[[], object]] = None, regime: str = "any",
                remember: bool = True, echo: Optional[Callable[[str], None]] = None,
                progress: bool = True) -> Optional[VerifyPolicy]:
    """The VerifyPolicy for ``target`` (an open Target) and ``draft`` (an open Draft or None).

    ``schedule``: a mode name (None: :func:`pick_mode`), or a VerifyPolicy (returned as is).
    ``proposer``: what proposes the blocks (default: the draft): whether it reports confidences and
    its memory tag.  ``cost_profile``: a profile path, Profile or CostModel instead of the cached
    auto curve.  ``calibration``: an STS calibration file bound to the draft.  ``on_measured``:
    called after the auto curve was measured in ``target``'s context (nothing cached yet).
    ``measure_full``: returns the full profile (target and draft) the ``profiled`` / ``static``
    modes without ``cost_profile`` use.  ``regime``: ``greedy`` / ``sampled`` / ``any``, part of the
    memory key.  ``remember``: start from, and keep, what earlier processes learned (only for the
    cached auto curve: a given profile is a test's or an experiment's).  ``echo`` / ``progress``:
    where a first-use measurement says so (:func:`.costprofile.auto_profile`; ``progress`` False:
    no progress bar, the notices through ``logging``, as a library called with ``verbose=False``).

    Raises ValueError on options that do not fit (a mode needing a draft or a confidence head,
    a threshold missing, a calibration with ``off``)."""
    if isinstance(schedule, VerifyPolicy):
        return schedule
    if schedule is not None and not isinstance(schedule, str):
        raise TypeError(f"schedule must be a mode name or a VerifyPolicy, got {type(schedule).__name__}")
    mode = pick_mode(schedule, conf_min, p_survival_min)
    if mode not in MODES:
        raise ValueError(f"schedule must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off" and calibration:
        raise ValueError("--calibration needs a schedule other than off")
    from pyllama_dspark.speculative.drafter import DraftModelProposer, NoDraft

    has_draft = draft is not None or (proposer is not None and not isinstance(proposer, NoDraft))
    if not has_draft:
        if mode not in ("off", "auto"):
            raise ValueError(f"the {mode} schedule needs a draft (-md)")
        return None
    if draft is not None and proposer is None:
        gamma = max(1, min(gamma, DraftModelProposer(draft).max_draft()))
    elif proposer is not None and hasattr(proposer, "max_draft"):
        gamma = max(1, min(gamma, proposer.max_draft()))
    temps = None
    if calibration:
        from pyllama_dspark.speculative.calibration import load_calibration

        temps = load_calibration(calibration, draft.path).temperatures

    def cost():
        if cost_profile is not None:
            if isinstance(cost_profile, (str, os.PathLike)):
                return costprofile.load(cost_profile)
            return cost_profile
        if mode == "auto":
            fresh = on_measured is not None and costprofile.known_profile(target) is None
            prof = costprofile.auto_profile(target, echo=echo, progress=progress)
            if fresh:
                on_measured()
            return prof
        if measure_full is None:
            raise ValueError(f"the {mode} schedule needs a cost profile (--profile)")
        return measure_full()

    policy = policy_for(mode, has_draft=True, has_confidence=proposer_confidence(proposer, draft), cost_source=cost,
                        conf_min=conf_min, p_survival_min=p_survival_min, temperatures=temps, gamma=gamma)
    if policy is not None and cost_profile is None and mode == "auto" and os.environ.get(costprofile.PROFILE_ENV) is None:
        # the cached curve: live cycles far off it drop it from the cache at close (heal.cycle)
        policy.profile_path = str(costprofile.default_path(costprofile.target_key(target)))
    if policy is not None and remember and cost_profile is None and mode == "auto":
        policy_memory.attach(policy, target, getattr(draft, "path", None), proposer_tag(proposer, draft), regime)
    return policy
