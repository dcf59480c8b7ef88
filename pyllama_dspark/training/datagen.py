"""Target responses + captured features + the target's top-k distribution, in one batched pass.

The target generates a response for every instruction with continuous batching (``slots``
sequences share each ``llama_decode``: new prompts are prefilled in the same batch as the running
sequences' next tokens).  Every decoded row's layer inputs for the draft's ``target_layers`` are
captured by the shim on the way, so the features cost nothing extra, and every output row's
logits give the target's distribution over the next token (kept as its top-k logits plus the
log-sum-exp of the full row, so the probabilities of the kept tokens are exact).

Each finished sequence is one training record:

* ``tokens`` int32 [L]: prompt (chat template applied) + response, ``n_prompt`` of them prompt;
* ``feats`` float16 [L-1, m*d]: features of positions 0..L-2 (the last token is never decoded);
* ``top_ids`` int32 [L-1-(n_prompt-1), k], ``top_logits`` float16, ``lse`` float32: the target's
  distribution of the token at position j+1 for the rows j = n_prompt-1 .. L-2.

Records are written in shards (``shard-00000.npz`` ...) with a ``manifest.jsonl`` listing the
instruction ids done, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

__all__ = ["GenConfig", "generate_dataset", "load_records", "Record"]

FP16_MAX = 65504.0


@dataclass
class GenConfig:
    slots: int = 32
    max_new: int = 384
    max_len: int = 640
    top_k: int = 24
    sampled_frac: float = 0.3
    temperature: float = 0.8
    min_p: float = 0.05
    seed: int = 0
    n_threads: Optional[int] = None
    shard_size: int = 64
    prefill_budget: int = 512


@dataclass
class Record:
    tokens: np.ndarray
    n_prompt: int
    feats: np.ndarray
    top_ids: np.ndarray
    top_logits: np.ndarray
    lse: np.ndarray
    source: str = ""
    sampled: bool = False


@dataclass
class _Slot:
    seq: int
    iid: int
    source: str
    sampled: bool
    tokens: List[int]
    n_prompt: int
    followup: Optional[str]
    messages: List[Dict[str, str]]
    feats: List[np.ndarray] = field(default_factory=list)
    top_ids: List[np.ndarray] = field(default_factory=list)
    top_logits: List[np.ndarray] = field(default_factory=list)
    lse: List[float] = field(default_factory=list)
    prefilled: bool = False


def _topk(row: np.ndarray, k: int):
    idx = np.argpartition(row, -k)[-k:]
    idx = idx[np.argsort(-row[idx])]
    m = float(row[idx[0]])
    lse = m + math.log(float(np.exp(row - m).sum()))
    return idx.astype(np.int32), row[idx].astype(np.float16), lse


def _sample(row: np.ndarray, temp: float, min_p: float, rng: np.random.Generator) -> int:
    z = (row - row.max()) / temp
    p = np.exp(z)
    p[p < min_p * p.max()] = 0.0
    p /= p.sum()
    return int(rng.choice(p.size, p=p))


class _ShardWriter:
    def __init__(self, out_dir: Path, shard_size: int):
        self.dir = out_dir
        self.shard_size = shard_size
        self.buf: List[tuple] = []
        existing = sorted(out_dir.glob("shard-*.npz"))
        self.next_index = len(existing)

    def add(self, iid: int, rec: Record) -> None:
        self.buf.append((iid, rec))
        if len(self.buf) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        if not self.buf:
            return
        recs = [r for _, r in self.buf]
        name = f"shard-{self.next_index:05d}.npz"
        tmp = self.dir / (name + ".tmp.npz")
        np.savez(
            tmp,
            tokens=np.concatenate([r.tokens for r in recs]),
            tok_off=np.cumsum([0] + [len(r.tokens) for r in recs]),
            n_prompt=np.array([r.n_prompt for r in recs], dtype=np.int32),
            feats=np.concatenate([r.feats for r in recs]),
            top_ids=np.concatenate([r.top_ids for r in recs]),
            top_logits=np.concatenate([r.top_logits for r in recs]),
            lse=np.concatenate([r.lse for r in recs]),
            sampled=np.array([r.sampled for r in recs], dtype=bool),
            source=np.array([r.source for r in recs]),
        )
        os.replace(tmp, self.dir / name)
        with open(self.dir / "manifest.jsonl", "a") as f:
            for iid, r in self.buf:
                f.write(json.dumps({"iid": iid, "shard": name, "n": int(len(r.tokens)),
                                    "n_prompt": int(r.n_prompt), "source": r.source,
                                    "sampled": bool(r.sampled)}) + "\n")
        self.next_index += 1
        self.buf = []


def done_ids(out_dir: Path) -> set:
    m = Path(out_dir) / "manifest.jsonl"
    if not m.exists():
        return set()
    return {json.loads(line)["iid"] for line in m.read_text().splitlines() if line.strip()}


def generate_dataset(target_path: str, capture_layers: Sequence[int], instructions: Sequence,
                     out_dir, cfg: GenConfig = GenConfig(),
                     progress: Optional[Callable[[int, int], None]] = None) -> Dict[str, float]:
    """Generate (or resume) the dataset for ``instructions`` into ``out_dir``; returns counters.

    Instruction ``i`` gets id ``i`` (its follow-up turn, when it has one, id ``i + 10**6``)."""
    from pyllama_dspark.chat.prompt import build_chat_prompt
    from pyllama_dspark.llama.handles import ContextSettings, Target

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = done_ids(out)
    rng = np.random.default_rng(cfg.seed + len(done))
    settings = ContextSettings(n_ctx=cfg.slots * cfg.max_len, n_batch=max(1024, cfg.prefill_budget + cfg.slots),
                               n_ubatch=max(1024, cfg.prefill_budget + cfg.slots), n_threads=cfg.n_threads,
                               n_seq_max=cfg.slots, flash_attn="auto")
    writer = _ShardWriter(out, cfg.shard_size)
    stats = {"sequences": 0, "tokens": 0, "response_tokens": 0, "clipped_features": 0, "steps": 0}
    with Target(target_path, settings, capture_layers=list(capture_layers)) as target:
        eog = target.eog_mask
        queue: List[tuple] = []
        for i, ins in enumerate(instructions):
            if i not in done:
                queue.append((i, ins.source, ins.messages, ins.followup))
        queue.reverse()  # pop() from the end = instruction order
        total = len(queue) + sum(1 for i, ins in enumerate(instructions) if ins.followup and i + 10**6 not in done)
        free = list(range(cfg.slots))[::-1]
        active: List[_Slot] = []
        n_done = 0

        def admit(budget: int) -> int:
            used = 0
            while queue and free and used < budget:
                iid, source, messages, followup = queue[-1]
                if iid in done:
                    queue.pop()
                    continue
                prompt = build_chat_prompt(target, messages).tokens
                if len(prompt) + 8 > cfg.max_len:
                    queue.pop()
                    continue
                if used and used + len(prompt) > budget:
                    break
                queue.pop()
                sampled = bool(rng.random() < cfg.sampled_frac)
                active.append(_Slot(free.pop(), iid, source, sampled, list(prompt), len(prompt),
                                    followup, list(messages)))
                used += len(prompt)
            return used

        while queue or active:
            admit(cfg.prefill_budget)
            toks, pos, seqs, outs, owners = [], [], [], [], []
            for s in active:
                if not s.prefilled:
                    n = len(s.tokens)
                    toks.extend(s.tokens)
                    pos.extend(range(n))
                    seqs.extend([s.seq] * n)
                    outs.extend([0] * (n - 1) + [1])
                    owners.append((s, len(toks) - n, n))
                else:
                    toks.append(s.tokens[-1])
                    pos.append(len(s.tokens) - 1)
                    seqs.append(s.seq)
                    outs.append(1)
                    owners.append((s, len(toks) - 1, 1))
            target.decode_rows(np.asarray(toks, dtype=np.int32), np.asarray(pos, dtype=np.int32),
                               np.asarray(seqs, dtype=np.int32), np.asarray(outs, dtype=np.int8))
            stats["steps"] += 1
            feats = target.features(0, len(toks))
            big = np.abs(feats) > FP16_MAX
            if big.any():
                stats["clipped_features"] += int(big.sum())
                np.clip(feats, -FP16_MAX, FP16_MAX, out=feats)
            feats16 = feats.astype(np.float16)
            finished: List[_Slot] = []
            for out_i, (s, r0, n) in enumerate(owners):
                s.feats.append(feats16[r0:r0 + n])
                s.prefilled = True
                row = target.logits_view(r0 + n - 1)
                ids, lg, lse = _topk(row, cfg.top_k)
                s.top_ids.append(ids)
                s.top_logits.append(lg)
                s.lse.append(lse)
                nxt = _sample(row, cfg.temperature, cfg.min_p, rng) if s.sampled else int(ids[0])
                s.tokens.append(nxt)
                n_resp = len(s.tokens) - s.n_prompt
                if eog[nxt] or n_resp >= cfg.max_new or len(s.tokens) >= cfg.max_len:
                    finished.append(s)
            for s in finished:
                active.remove(s)
                target.seq_rm(s.seq, 0, -1)
                free.append(s.seq)
                rec = Record(tokens=np.asarray(s.tokens, dtype=np.int32), n_prompt=s.n_prompt,
                             feats=np.concatenate(s.feats), top_ids=np.stack(s.top_ids),
                             top_logits=np.stack(s.top_logits), lse=np.asarray(s.lse, dtype=np.float32),
                             source=s.source, sampled=s.sampled)
                writer.add(s.iid, rec)
                stats["sequences"] += 1
                stats["tokens"] += len(s.tokens)
                stats["response_tokens"] += len(s.tokens) - s.n_prompt
                n_done += 1
                if progress:
                    progress(n_done, total)
                if s.followup and s.iid < 10**6 and (s.iid + 10**6) not in done:
                    reply = target.detokenize(s.tokens[s.n_prompt:], special=False).decode("utf-8", "replace")
                    msgs = s.messages + [{"role": "assistant", "content": reply.strip()},
                                         {"role": "user", "content": s.followup}]
                    queue.append((s.iid + 10**6, "multiturn", msgs, None))
        writer.flush()
    return stats


def load_records(data_dir) -> List[Record]:
    """Every record of a dataset directory (features stay float16)."""
    recs: List[Record] = []
    for shard in sorted(Path(data_dir).glob("shard-*.npz")):
        with np.load(shard) as zf:
            z = {k: zf[k] for k in zf.files}   # each member read once (NpzFile reads on every access)
        off = z["tok_off"]
        fo = to = 0
        for i in range(len(off) - 1):
            toks = z["tokens"][off[i]:off[i + 1]]
            npr = int(z["n_prompt"][i])
            nf = len(toks) - 1
            nt = len(toks) - npr
            recs.append(Record(tokens=toks, n_prompt=npr, feats=z["feats"][fo:fo + nf],
                               top_ids=z["top_ids"][to:to + nt], top_logits=z["top_logits"][to:to + nt],
                               lse=z["lse"][to:to + nt], source=str(z["source"][i]),
                               sampled=bool(z["sampled"][i])))
            fo += nf
            to += nt
    return recs


def load_responses(data_dir, sources: Optional[Sequence[str]] = None) -> List[np.ndarray]:
    """The response tokens of a dataset's records (of ``sources`` only, when given), without
    reading their features."""
    out: List[np.ndarray] = []
    for shard in sorted(Path(data_dir).glob("shard-*.npz")):
        with np.load(shard) as zf:
            toks, off, npr, src = zf["tokens"], zf["tok_off"], zf["n_prompt"], zf["source"]
        for i in range(len(off) - 1):
            if sources is None or str(src[i]) in sources:
                out.append(toks[off[i] + int(npr[i]):off[i + 1]])
    return out
