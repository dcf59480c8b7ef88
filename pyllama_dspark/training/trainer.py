"""Training loop: the DSpark objective (paper §3.3) on a dataset written by :mod:`.datagen`.

Per block slot i (predicting the token at ``anchor + 1 + i``), weight ``exp(-i / gamma)``:

* ``0.1 · CE`` against the target's argmax token (what greedy verification accepts);
* ``0.9 · TV(p_d, p_t)`` with p_t the target's distribution from its stored top-k logits (the
  exact probabilities of those k tokens; the target's remaining mass is treated as 0);
* ``1.0 · BCE(c_i, 1 - TV)`` for the confidence head (its inputs detached: the head learns to read
  the draft, it does not reshape it).

Random anchors in every sequence's response part; blocks of one sequence share its context.
Checkpoints (model + optimizer + step) make the run resumable; losses go to ``train_log.jsonl``.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, asdict
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

import numpy as np
import torch

from pyllama_dspark.training.datagen import Record
from pyllama_dspark.training.model import DSparkDraft

__all__ = ["TrainConfig", "select_vocab", "Batcher", "block_losses", "train", "evaluate_records"]


@dataclass
class TrainConfig:
    steps: int = 3000
    seqs_per_step: int = 4
    anchors_per_seq: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 100
    gamma: float = 7.0
    ce_w: float = 0.1
    tv_w: float = 0.9
    conf_w: float = 1.0
    max_minutes: float = 0.0
    ckpt_every: int = 200
    eval_every: int = 500
    seed: int = 0
    threads: int = 0


def select_vocab(records: Sequence[Record], size: int, always: Sequence[int] = ()) -> np.ndarray:
    """The ``size`` most frequent target tokens of the responses and the target's argmax labels
    (ties by id), plus ``always`` (e.g. end-of-generation tokens); sorted ids (the ``d2t`` table)."""
    counts: Dict[int, int] = {}
    for r in records:
        resp = r.tokens[r.n_prompt:]
        for arr in (resp, r.top_ids[:, 0]):
            u, c = np.unique(arr, return_counts=True)
            for t, n in zip(u.tolist(), c.tolist()):
                counts[t] = counts.get(t, 0) + n
    keep = set(int(t) for t in always)
    for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(keep) >= size:
            break
        keep.add(t)
    return np.array(sorted(keep), dtype=np.int64)


class Batcher:
    """Turns records into per-sequence training blocks (numpy -> torch)."""

    def __init__(self, records: Sequence[Record], block_size: int, t2d: np.ndarray, pad_token: int):
        self.records = list(records)
        self.B = block_size
        self.t2d = t2d
        self.pad = pad_token

    def item(self, idx: int, n_anchors: int, rng: np.random.Generator, all_anchors: bool = False):
        r = self.records[idx]
        L, npr, B = len(r.tokens), r.n_prompt, self.B
        lo, hi = npr, L - 2                     # anchors: response tokens with >= 1 successor
        if hi < lo:
            return None
        cand = np.arange(lo, hi + 1)
        if not all_anchors and len(cand) > n_anchors:
            cand = np.sort(rng.choice(cand, size=n_anchors, replace=False))
        anchors = cand
        toks = np.concatenate([r.tokens, np.full(B + 1, self.pad, dtype=np.int32)]).astype(np.int64)
        slot = np.arange(B)
        j = anchors[:, None] + slot[None, :]              # row predicting token j+1
        valid = j <= L - 2
        row = np.clip(j - (npr - 1), 0, len(r.top_ids) - 1)
        top_ids = r.top_ids[row]                           # [nb, B, k] target ids
        top_lg = r.top_logits[row].astype(np.float32)
        lse = r.lse[row]
        p_t = np.exp(top_lg - lse[..., None])
        d_ids = self.t2d[top_ids]                          # -1 outside the draft vocab
        label = d_ids[..., 0]
        feats = torch.from_numpy(r.feats[:anchors.max()].astype(np.float32))
        return dict(feats=feats, tokens=torch.from_numpy(toks), anchors=torch.from_numpy(anchors),
                    valid=torch.from_numpy(valid), label=torch.from_numpy(label),
                    d_ids=torch.from_numpy(d_ids), p_t=torch.from_numpy(p_t.astype(np.float32)),
                    target_label=torch.from_numpy(top_ids[..., 0].astype(np.int64)))


def block_losses(model: DSparkDraft, b: dict, cfg: TrainConfig, use_markov: bool = True):
    """(total loss, metrics dict) for one sequence's blocks."""
    u, h, w1p = model.forward_blocks(b["feats"], b["tokens"], b["anchors"], use_markov=use_markov)
    logp = torch.log_softmax(u, dim=-1)
    pd = logp.exp()
    valid = b["valid"]
    B = u.shape[1]
    w = torch.exp(-torch.arange(B, dtype=torch.float32) / cfg.gamma)[None, :].expand_as(valid)
    w = w * valid
    label = b["label"]
    has = label >= 0
    ce = -torch.gather(logp, -1, label.clamp(min=0)[..., None]).squeeze(-1) * has
    d_ids = b["d_ids"]
    inv = d_ids >= 0
    pd_k = torch.gather(pd, -1, d_ids.clamp(min=0)) * inv
    pt_k = b["p_t"] * inv
    tv = 0.5 * ((pd_k - pt_k).abs() - pd_k).sum(-1) + 0.5
    tv = tv.clamp(0.0, 1.0)
    c = model.confidence(h.detach(), w1p.detach())
    tgt = (1.0 - tv).detach()
    bce = -(tgt * torch.log(c.clamp_min(1e-6)) + (1 - tgt) * torch.log((1 - c).clamp_min(1e-6)))
    wsum = w.sum().clamp_min(1e-6)
    loss = (w * (cfg.ce_w * ce + cfg.tv_w * tv + cfg.conf_w * bce)).sum() / wsum
    with torch.no_grad():
        pred = model.d2t[u.argmax(-1)]
        match = (pred == b["target_label"]) & valid
    with torch.no_grad():
        parts = dict(ce=float((w * ce).sum() / wsum), tv=float((w * tv).sum() / wsum),
                     bce=float((w * bce).sum() / wsum))
    return loss, parts, match, valid, c.detach()


def tau_from_matches(match: torch.Tensor, valid: torch.Tensor) -> float:
    """1 + E[accepted prefix length] over blocks, greedy: slot k counts if slots 0..k all match."""
    m = (match | ~valid).to(torch.int64)
    m = m * valid[:, :1].to(torch.int64)
    run = torch.cumprod(m, dim=1) * valid
    return float(1.0 + run.sum(1).float().mean())


def evaluate_records(model: DSparkDraft, batcher: Batcher, idxs: Sequence[int], use_markov: bool = True,
                     max_anchors: int = 64, seed: int = 0) -> Dict[str, float]:
    """Teacher-forced greedy acceptance on held-out sequences: tau estimate and per-slot rates."""
    rng = np.random.default_rng(seed)
    cfg = TrainConfig()
    taus, acc_num, acc_den = [], None, None
    with torch.no_grad():
        for i in idxs:
            b = batcher.item(i, max_anchors, rng)
            if b is None:
                continue
            _, _, match, valid, _ = block_losses(model, b, cfg, use_markov)
            taus.append((tau_from_matches(match, valid), int(valid.shape[0])))
            m = match.float().sum(0)
            v = valid.float().sum(0)
            acc_num = m if acc_num is None else acc_num + m
            acc_den = v if acc_den is None else acc_den + v
    tot = sum(n for _, n in taus)
    tau = sum(t * n for t, n in taus) / max(1, tot)
    return {"tau": tau, "slot_acc": (acc_num / acc_den.clamp_min(1)).tolist() if acc_num is not None else []}


def _lr(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def train(model: DSparkDraft, batcher: Batcher, train_idx: Sequence[int], eval_idx: Sequence[int],
          cfg: TrainConfig, out_dir, log: Optional[Callable[[dict], None]] = None,
          progress=None) -> Dict[str, float]:
    """Train (resuming from ``out_dir/ckpt.pt`` when present); returns the last eval metrics."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    step = 0
    ck = out / "ckpt.pt"
    if ck.exists():
        st = torch.load(ck, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step = int(st["step"])
    rng = np.random.default_rng(cfg.seed + step)
    t0 = time.time()
    logf = open(out / "train_log.jsonl", "a")
    metrics: Dict[str, float] = {}

    def save():
        tmp = out / "ckpt.pt.tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "spec": model.spec.to_dict(), "cfg": asdict(cfg)}, tmp)
        os.replace(tmp, ck)

    train_idx = list(train_idx)
    while step < cfg.steps:
        if cfg.max_minutes and (time.time() - t0) / 60 > cfg.max_minutes:
            break
        for gparam in opt.param_groups:
            gparam["lr"] = _lr(step, cfg)
        opt.zero_grad(set_to_none=True)
        agg = {"loss": 0.0, "ce": 0.0, "tv": 0.0, "bce": 0.0}
        taus = []
        n = 0
        for i in rng.choice(len(train_idx), size=cfg.seqs_per_step, replace=False):
            b = batcher.item(train_idx[i], cfg.anchors_per_seq, rng)
            if b is None:
                continue
            loss, m, match, valid, _ = block_losses(model, b, cfg)
            (loss / cfg.seqs_per_step).backward()
            agg["loss"] += float(loss.detach())
            for k in ("ce", "tv", "bce"):
                agg[k] += m[k]
            taus.append(tau_from_matches(match, valid))
            n += 1
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        rec = {k: v / max(1, n) for k, v in agg.items()}
        rec.update(step=step, lr=_lr(step - 1, cfg), tau_train=float(np.mean(taus)) if taus else 0.0,
                   elapsed_s=round(time.time() - t0, 1))
        if step % cfg.eval_every == 0 or step == cfg.steps:
            ev = evaluate_records(model, batcher, eval_idx)
            rec["tau_eval"] = ev["tau"]
            rec["slot_acc_eval"] = [round(x, 3) for x in ev["slot_acc"]]
            metrics = rec
        logf.write(json.dumps(rec) + "\n")
        logf.flush()
        if log:
            log(rec)
        if progress:
            progress(step)
        if step % cfg.ckpt_every == 0:
            save()
    save()
    logf.close()
    return metrics
