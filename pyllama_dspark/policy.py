"""Verification policy: how many of each request's drafted tokens to verify, and whether to draft.

Modes (``--schedule``):
  off        verify every drafted token (fixed block length, llama.cpp's default)
  static     cut at the first confidence below ``conf_min`` (llama.cpp's --spec-draft-p-min)
  survival   cut where the prefix survival prod(c) falls below ``p_survival_min``
  profiled   Algorithm 1 on the machine's profiled cost curve (draft cost included), and no draft
             pass at all while the running survival estimates say drafting cannot pay

Every decision uses only what is known before the token it admits (confidences c_k depend on the
tokens before position k, the running estimates on past cycles), so every mode is lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import numpy as np

from .schedule import CostModel, apply_sts, schedule, should_draft, static_cut, survival, survival_cut

MODES = ("off", "static", "survival", "profiled")


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
    _acc: np.ndarray = field(default=None, repr=False)
    _skipped: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"schedule must be one of {MODES}, got {self.mode!r}")
        if self.mode == "profiled" and self.cost is None:
            raise ValueError("the profiled schedule needs a cost profile")
        if not 0.0 <= self.conf_min <= 1.0 or not 0.0 <= self.p_survival_min <= 1.0:
            raise ValueError("conf_min and p_survival_min must be in [0, 1]")
        # optimistic start: drafting is tried until evidence says it does not pay
        self._acc = np.full(self.gamma, 0.9)

    @property
    def needs_confidence(self) -> bool:
        return self.mode in ("static", "survival", "profiled")

    def calibrated(self, conf: np.ndarray) -> np.ndarray:
        c = np.asarray(conf, dtype=np.float64)
        if self.temperatures is None or c.size == 0:
            return c
        return apply_sts(c[None, :], self.temperatures)[0]

    # ---- before drafting ----------------------------------------------------------------------
    def want_draft(self, n_requests: int) -> bool:
        if self.mode != "profiled":
            return True
        est = [survival(self._acc)] * max(1, n_requests)
        if should_draft(est, self.cost):
            self._skipped = 0
            return True
        self._skipped += 1
        if self.probe_every and self._skipped >= self.probe_every:  # keep the estimates alive
            self._skipped = 0
            return True
        return False

    # ---- after drafting -------------------------------------------------------------------------
    def lengths(self, confs: Sequence[Optional[np.ndarray]], n_drafted: Sequence[int]) -> List[int]:
        """Verify lengths per request from the (raw) confidences of its drafted tokens."""
        if self.mode == "off" or not any(n_drafted):
            return list(n_drafted)
        out = []
        if self.mode in ("static", "survival"):
            for c, n in zip(confs, n_drafted):
                if c is None:
                    raise ValueError(f"the {self.mode} schedule needs a draft with a confidence head")
                c = self.calibrated(c[:n])
                out.append(static_cut(c, self.conf_min) if self.mode == "static" else
                           survival_cut(c, self.p_survival_min))
            return out
        surv = []
        for c, n in zip(confs, n_drafted):
            if c is None:
                raise ValueError("the profiled schedule needs a draft with a confidence head")
            surv.append(survival(self.calibrated(c[:n])))
        return schedule(surv, self.cost, drafted=True).lengths

    def update(self, n_verified: int, n_accepted: int) -> None:
        """Running conditional acceptance per position from one verified block."""
        for k in range(min(n_verified, self.gamma)):
            if k > n_accepted:
                break
            hit = 1.0 if k < n_accepted else 0.0
            self._acc[k] += self.ema * (hit - self._acc[k])
