"""STS calibration files: fitted on real decoding, bound to the draft by its content hash."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from pyllama_dspark.errors import DSparkError
from pyllama_dspark.speculative.schedule import calibration_report, fit_sts

CALIBRATION_VERSION = 1


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Calibration:
    draft_sha256: str
    temperatures: List[float]
    report: List[dict] = field(default_factory=list)   # per position, on the held-out half
    n_fit: int = 0
    n_eval: int = 0
    version: int = CALIBRATION_VERSION

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))


def load_calibration(path, draft_path: Optional[str] = None) -> Calibration:
    try:
        data = json.loads(Path(path).read_text())
        cal = Calibration(**data)
    except (OSError, ValueError, TypeError) as e:
        raise DSparkError(f"cannot read calibration file {path}: {e}") from None
    if cal.version != CALIBRATION_VERSION:
        raise DSparkError(f"{path}: calibration version {cal.version} != {CALIBRATION_VERSION}")
    if draft_path is not None and file_sha256(draft_path) != cal.draft_sha256:
        raise DSparkError(f"{path} was fitted for another draft (content hash differs from {draft_path})")
    return cal


def records_to_arrays(records: Sequence[tuple], gamma: int):
    """(conf, verified, accepted) records -> conf [N, gamma] (padded with 1), verified [N], accepted [N]."""
    conf = np.ones((len(records), gamma))
    ver = np.zeros(len(records), dtype=int)
    acc = np.zeros(len(records), dtype=int)
    for i, (c, k, a) in enumerate(records):
        n = min(len(c), gamma)
        conf[i, :n] = c[:n]
        ver[i] = min(k, gamma)
        acc[i] = a
    return conf, ver, acc


def fit(records_fit: Sequence[tuple], records_eval: Sequence[tuple], gamma: int, draft_path: str) -> Calibration:
    if len(records_fit) == 0 or len(records_eval) == 0:
        raise DSparkError("not enough drafted blocks to calibrate (need some for fitting and for evaluation)")
    cf, vf, af = records_to_arrays(records_fit, gamma)
    ce, ve, ae = records_to_arrays(records_eval, gamma)
    temps = fit_sts(cf, af, vf)
    rep = calibration_report(ce, ae, temps, ve)
    return Calibration(file_sha256(draft_path), [float(t) for t in temps], rep, len(records_fit), len(records_eval))


def reliability_png(records: Sequence[tuple], temps: Sequence[float], gamma: int, path, n_bins: int = 10) -> None:
    """Reliability diagram of the cumulative survival per position, raw vs STS-calibrated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pyllama_dspark.speculative.schedule import apply_sts, joint_labels

    conf, ver, acc = records_to_arrays(records, gamma)
    y = joint_labels(acc, gamma)
    curves = {"raw": np.cumprod(conf, axis=1), "STS": np.cumprod(apply_sts(conf, temps), axis=1)}
    cols = min(gamma, 4)
    rows = (gamma + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    edges = np.linspace(0, 1, n_bins + 1)
    for k in range(gamma):
        ax = axes[k // cols][k % cols]
        m = ver > k
        for name, a in curves.items():
            p, t = a[m, k], y[m, k]
            idx = np.minimum((p * n_bins).astype(int), n_bins - 1)
            xs = [p[idx == b].mean() for b in range(n_bins) if (idx == b).any()]
            ys = [t[idx == b].mean() for b in range(n_bins) if (idx == b).any()]
            ax.plot(xs, ys, "o-", label=name, markersize=3)
        ax.plot(edges, edges, "k:", linewidth=0.8)
        ax.set_title(f"position {k + 1} (n={int(m.sum())})", fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    for k in range(gamma, rows * cols):
        axes[k // cols][k % cols].axis("off")
    axes[0][0].legend(fontsize=8)
    fig.supxlabel("predicted prefix survival")
    fig.supylabel("empirical prefix survival")
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=90)
    plt.close(fig)
