"""Cross-checks for when acceptance looks wrong: is it the loop, llama.cpp, the draft graph, or the draft?

Per prompt (chat template applied, greedy):

1. **plain greedy**: our speculative loop's tokens against plain greedy decoding of the target
   through llama-cpp-python's ``Llama`` (an independent path).  At the first divergence the
   target's top-2 logit margin tells a numerical near-tie (batch shapes / kernels) from a bug;
2. **llama.cpp's C++ driver** (when a ``llama-server`` binary is given): the same target, draft and
   settings through llama-server's DSpark/DFlash path: same tokens, same drafted / accepted totals
   (its ``timings``) and the same per-step (drafted, accepted) sequence (``LLAMA_TRACE=1`` log);
3. **the draft graph**: on sampled blocks of the committed sequence, llama.cpp's draft logits and
   confidences against the numpy reference (:mod:`pyllama_dspark.reference`, float64) fed with
   the very target features llama.cpp injected; max error per tensor, argmax agreement away from
   near-ties, and non-finite outputs.

Over all prompts: the per-position conditional acceptance curve, with a warning when its shape
looks like a positional bug (a sound position 1, then a flat collapse: what a wrong RoPE pairing
does to a trained draft -- the llama.cpp PR thread's tau stalling at ~2).

A *mismatch* (a real greedy divergence, any disagreement with llama.cpp's driver, a draft-graph
error above tolerance) makes the report fail; near-ties and the curve are warnings.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

# ---- greedy reference ------------------------------------------------------------------------


def open_plain_llama(target: str, n_ctx: int, n_batch: int, flash_attn: str, n_threads: Optional[int]):
    from llama_cpp import Llama

    kw = dict(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, flash_attn=flash_attn != "off", verbose=False)
    if n_threads:
        kw.update(n_threads=n_threads, n_threads_batch=n_threads)
    return Llama(model_path=target, **kw)


def plain_greedy(llm, prompt: Sequence[int], n: int) -> List[int]:
    """Up to n greedy tokens of the target alone (an end-of-generation token ends and is kept)."""
    import llama_cpp

    llm.reset()
    out: List[int] = []
    for tok in llm.generate(list(prompt), temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok) or len(out) >= n:
            break
    return out


def top2_margin(llm, prefix: Sequence[int]) -> float:
    """Gap between the target's best and second-best logit after ``prefix`` (plain decoding)."""
    import llama_cpp

    llm.reset()
    llm.eval(list(prefix))
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)  # Llama.scores holds no rows without logits_all
    row = np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float64)
    top = np.sort(row)[-2:]
    return float(top[1] - top[0])


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first difference; -1 when equal (a strict prefix diverges at its end)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


# ---- acceptance curve ------------------------------------------------------------------------


def curve_warning(accept: Sequence[Optional[float]], tried: Sequence[int], *, min_tried: int = 10,
                  min_first: float = 0.2, collapse: float = 0.35) -> Optional[str]:
    """A warning when the per-position conditional acceptance looks like a positional bug.

    ``accept[k]`` = P(position k+1 accepted | earlier accepted), ``tried[k]`` = how often position
    k+1 was reached.  Flagged: position 1 accepts well (>= ``min_first``) and every later position
    with enough trials (>= ``min_tried``) stays below ``collapse`` x position 1 -- a flat collapse
    after position 1 (deeper block positions lost their positional signal)."""
    if not accept or accept[0] is None or tried[0] < min_tried or accept[0] < min_first:
        return None
    later = [a for a, t in zip(accept[1:], tried[1:]) if a is not None and t >= min_tried]
    if not later:
        return None
    if max(later) < collapse * accept[0]:
        vals = ", ".join(f"{a:.2f}" for a in [accept[0]] + later)
        return (f"per-position acceptance collapses after position 1 ({vals}): deeper block positions get no "
                f"positional signal -- check the draft's RoPE pairing (NeoX vs interleaved), positions of "
                f"the injected features and the block layout (anchor-first vs bonus slot)")
    return None


# ---- draft graph vs numpy reference ----------------------------------------------------------


@dataclass
class BlockCheck:
    pos0: int
    rows: int
    max_err_logits: float
    rel_err_logits: float
    max_err_conf: Optional[float]
    argmax_disagree: int          # rows whose argmax differs although the reference margin is clear
    near_ties: int
    nonfinite: bool
    ok: bool


def _target_features(target, seq: np.ndarray, upto: int) -> np.ndarray:
    """Captured features of positions 0..upto-1 (decoded in n_batch chunks on a cleared memory)."""
    target.seq_rm(0, 0, -1)
    feats = np.empty((upto, target.feature_width), dtype=np.float32)
    nb = target.n_batch
    for c0 in range(0, upto, nb):
        chunk = np.ascontiguousarray(seq[c0:min(upto, c0 + nb)], dtype=np.int32)
        target.decode(chunk, c0, 0, all_outputs=False)
        feats[c0:c0 + len(chunk)] = target.features(0, len(chunk))
    target.seq_rm(0, 0, -1)
    return feats


def check_draft_graph(sp, reference, sequence: Sequence[int], positions: Sequence[int], *,
                      rel_tol: float = 0.03, conf_tol: float = 0.05) -> List[BlockCheck]:
    """llama.cpp's draft blocks at ``positions`` of ``sequence`` against the numpy reference.

    ``sp``: a Speculator with a draft (its contexts are used and left empty); ``reference``: a
    :class:`~pyllama_dspark.reference.model.DraftReference` of the same draft and target."""
    draft, target, prop = sp.draft, sp.target, sp.proposer
    meta = draft.meta
    seq = np.asarray(list(sequence), dtype=np.int32)
    positions = sorted({int(p) for p in positions if 1 <= int(p) < len(seq)})
    if not positions:
        return []
    feats = _target_features(target, seq, positions[-1])
    n_block = max(1, min(sp.n_max, prop.max_draft())) + prop.offset
    block = np.full(n_block, meta.mask_token_id, dtype=np.int32)
    conf_buf = np.zeros(n_block, dtype=np.float32)
    draft.seq_rm(0, 0, -1)
    reference.clear()
    injected = 0
    out: List[BlockCheck] = []
    try:
        for p in positions:
            rows, pos = feats[injected:p], np.arange(injected, p, dtype=np.int32)
            draft.inject(rows, pos)
            reference.inject(rows.astype(np.float64), pos)
            injected = p
            block[0] = seq[p]
            draft.decode_block(block, p, 0)
            ll_logits = np.stack([draft.logits(i) for i in range(n_block)]).astype(np.float64)
            ll_conf = None
            if meta.has_confidence:
                draft.confidence(0, n_block, conf_buf)
                ll_conf = conf_buf.astype(np.float64).copy()
            draft.seq_rm(0, p, -1)
            # follow llama.cpp's own argmax chain through the Markov head (like for like)
            prev = None
            if meta.has_markov:
                beg = meta.block_offset
                prev = np.full(n_block, -1, dtype=np.int64)
                prev[beg] = int(seq[p])
                for i in range(beg + 1, n_block):
                    row = ll_logits[i - 1]   # -inf off a reduced (d2t) vocabulary is by design
                    ok_row = not np.isnan(row).any() and not np.isposinf(row).any() and np.isfinite(row).any()
                    prev[i] = int(np.argmax(row)) if ok_row else 0
            ref = reference.block(block.tolist(), p, prev=prev)
            out.append(_compare_block(p, ll_logits, ll_conf, ref, prop.offset, rel_tol, conf_tol))
    finally:
        draft.seq_rm(0, 0, -1)
        reference.clear()
    return out


def _compare_block(p, ll_logits, ll_conf, ref, offset, rel_tol, conf_tol) -> BlockCheck:
    r_logits = np.asarray(ref.logits, dtype=np.float64)
    finite_ref = np.isfinite(r_logits)
    nonfinite = bool(np.any(~np.isfinite(ll_logits) & finite_ref))
    with np.errstate(invalid="ignore"):
        diff = np.where(finite_ref, np.abs(ll_logits - r_logits), 0.0)
    diff = np.where(np.isnan(diff), np.inf, diff)
    max_err = float(diff.max()) if diff.size else 0.0
    scale = float(np.abs(np.where(finite_ref, r_logits, 0.0)).max()) or 1.0
    rel = max_err / scale
    conf_err = None
    if ll_conf is not None and ref.conf is not None:
        c = np.abs(ll_conf[offset:] - np.asarray(ref.conf)[offset:])
        conf_err = float(np.nan_to_num(c, nan=np.inf).max()) if c.size else 0.0
    disagree = ties = 0
    for i in range(offset, r_logits.shape[0]):
        if np.isnan(ll_logits[i]).any() or (~np.isfinite(ll_logits[i]) & finite_ref[i]).any():
            disagree += 1
            continue
        a_ll, a_ref = int(np.argmax(ll_logits[i])), int(np.argmax(r_logits[i]))
        if a_ll == a_ref:
            continue
        top = np.sort(r_logits[i][finite_ref[i]])[-2:]
        if top[1] - top[0] <= 2.0 * max(float(diff[i].max()), 1e-6):
            ties += 1
        else:
            disagree += 1
    ok = (not nonfinite) and rel <= rel_tol and disagree == 0 and (conf_err is None or conf_err <= conf_tol)
    return BlockCheck(p, int(r_logits.shape[0]), max_err, rel, conf_err, disagree, ties, nonfinite, ok)


# ---- the whole report ------------------------------------------------------------------------


@dataclass
class PromptReport:
    name: str
    n_prompt: int
    n_generated: int
    drafted: int
    accepted: int
    greedy: str = "match"                 # match | near-tie | MISMATCH
    divergence: int = -1
    margin: Optional[float] = None
    cpp: Optional[Dict] = None            # llama-server comparison
    blocks: List[BlockCheck] = field(default_factory=list)
    ok: bool = True

    def as_dict(self) -> dict:
        d = asdict(self)
        return d


@dataclass
class CrosscheckReport:
    prompts: List[PromptReport]
    accept_per_position: List[Optional[float]]
    tried_per_position: List[int]
    warnings: List[str]

    @property
    def mismatches(self) -> int:
        return sum(1 for p in self.prompts if not p.ok)

    @property
    def ok(self) -> bool:
        return self.mismatches == 0

    def as_dict(self) -> dict:
        return {"ok": self.ok, "mismatches": self.mismatches, "warnings": self.warnings,
                "accept_per_position": self.accept_per_position, "tried_per_position": self.tried_per_position,
                "prompts": [p.as_dict() for p in self.prompts]}


def cpp_compare(server, prompt: Sequence[int], ours, n_predict: int) -> Dict:
    cpp = server.complete(list(prompt), n_predict)
    t = cpp["timings"]
    c_steps = [(int(s[0]), int(s[1])) for s in cpp["steps"]]
    o_steps = [(d, a) for d, a in zip(ours.stats.verify_lengths, ours.stats.cycle_accepted) if d > 0]
    row = {"tokens_equal": cpp["tokens"] == list(ours.tokens),
           "first_divergence": first_divergence(list(ours.tokens), cpp["tokens"]),
           "cpp_drafted": int(t.get("draft_n", 0)), "cpp_accepted": int(t.get("draft_n_accepted", 0)),
           "ours_drafted": int(ours.stats.drafted), "ours_accepted": int(ours.stats.accepted),
           "steps_equal": c_steps == o_steps, "cpp_steps": len(c_steps), "ours_steps": len(o_steps)}
    row["ok"] = bool(row["tokens_equal"] and row["steps_equal"] and row["cpp_drafted"] == row["ours_drafted"]
                     and row["cpp_accepted"] == row["ours_accepted"])
    return row


def sample_positions(n_prompt: int, n_total: int, k: int, rng: np.random.Generator) -> List[int]:
    """k block positions: the end of the prompt, then random committed positions after it."""
    if k <= 0 or n_total < 2:
        return []
    pos = {min(n_prompt, n_total - 1)}
    cands = list(range(max(1, n_prompt // 2), n_total))
    while len(pos) < min(k, len(cands)):
        pos.add(int(rng.choice(cands)))
    return sorted(pos)


def run_crosscheck(sp, plain_llm, prompts: Sequence[tuple], n_predict: int, *, server=None, reference=None,
                   ref_blocks: int = 2, tie_eps: float = 1e-3, rel_tol: float = 0.03, conf_tol: float = 0.05,
                   seed: int = 0, progress=None) -> CrosscheckReport:
    """``prompts``: (name, token ids) pairs.  ``sp``: a Speculator with the draft; ``plain_llm``: a
    llama_cpp.Llama of the target; ``server``: a started LlamaServer or None; ``reference``: a
    DraftReference or None (no draft-graph check)."""
    rng = np.random.default_rng(seed)
    reports: List[PromptReport] = []
    width = 0
    pd: List[int] = []
    pa: List[int] = []
    for name, prompt in prompts:
        ours = sp.generate(list(prompt), n_predict)
        st = ours.stats
        rep = PromptReport(name, len(prompt), len(ours.tokens), st.drafted, st.accepted)
        width = max(width, len(st.pos_drafted))
        pd.extend([0] * (width - len(pd)))
        pa.extend([0] * (width - len(pa)))
        for k, v in enumerate(st.pos_drafted):
            pd[k] += v
        for k, v in enumerate(st.pos_accepted):
            pa[k] += v
        ref = plain_greedy(plain_llm, prompt, n_predict)
        i = first_divergence(list(ours.tokens), ref)
        if i >= 0:
            rep.divergence = i
            rep.margin = top2_margin(plain_llm, list(prompt) + ref[:i])
            rep.greedy = "near-tie" if rep.margin < tie_eps else "MISMATCH"
            if rep.greedy == "MISMATCH":
                rep.ok = False
        if server is not None:
            rep.cpp = cpp_compare(server, prompt, ours, n_predict)
            rep.ok = rep.ok and rep.cpp["ok"]
        if reference is not None and ref_blocks > 0:
            seq = list(prompt) + list(ours.tokens)
            rep.blocks = check_draft_graph(sp, reference, seq, sample_positions(len(prompt), len(seq), ref_blocks, rng),
                                           rel_tol=rel_tol, conf_tol=conf_tol)
            rep.ok = rep.ok and all(b.ok for b in rep.blocks)
        reports.append(rep)
        if progress is not None:
            progress(rep)
    acc = [a / d if d else None for a, d in zip(pa, pd)]
    warnings: List[str] = []
    w = curve_warning(acc, pd)
    if w:
        warnings.append(w)
    ties = [r.name for r in reports if r.greedy == "near-tie"]
    if ties:
        warnings.append(f"greedy near-ties (not bugs: top-2 margin < {tie_eps}) on: {', '.join(ties)}")
    if pd and sum(pd) >= 10 and sum(pa) == 0:
        warnings.append("no draft token was ever accepted: an untrained (random) draft, or a draft made for "
                        "another target?")
    return CrosscheckReport(reports, acc, pd, warnings)


def report_text(rep: CrosscheckReport, *, with_cpp: bool, with_ref: bool) -> str:
    from tabulate import tabulate

    rows = []
    for p in rep.prompts:
        g = p.greedy if p.divergence < 0 else f"{p.greedy} @{p.divergence} (margin {p.margin:.4f})"
        row = [p.name, p.n_prompt, p.n_generated, f"{p.accepted}/{p.drafted}", g]
        if with_cpp:
            c = p.cpp or {}
            row.append("match" if c.get("ok") else
                       (f"MISMATCH tokens {'=' if c.get('tokens_equal') else '!='} "
                        f"ours {c.get('ours_accepted')}/{c.get('ours_drafted')} "
                        f"cpp {c.get('cpp_accepted')}/{c.get('cpp_drafted')} "
                        f"steps {'=' if c.get('steps_equal') else '!='}"))
        if with_ref:
            if not p.blocks:
                row.append("-")
            else:
                worst = max(p.blocks, key=lambda b: (not b.ok, b.rel_err_logits))
                conf = "" if worst.max_err_conf is None else f" conf {worst.max_err_conf:.1e}"
                tag = "ok" if all(b.ok for b in p.blocks) else "MISMATCH"
                nf = " NON-FINITE" if worst.nonfinite else ""
                row.append(f"{tag}{nf}: logits max {worst.max_err_logits:.2e} (rel {worst.rel_err_logits:.1e})"
                           f"{conf}, argmax !={worst.argmax_disagree} ties {worst.near_ties} [{len(p.blocks)} blocks]")
        rows.append(row)
    headers = ["prompt", "prompt_n", "gen_n", "accepted/drafted", "vs plain greedy"]
    if with_cpp:
        headers.append("vs llama-server (C++)")
    if with_ref:
        headers.append("draft graph vs numpy reference")
    parts = [tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)]
    curve = " ".join("n/a" if a is None else f"{a:.3f}" for a in rep.accept_per_position)
    tried = " ".join(str(t) for t in rep.tried_per_position)
    parts.append(f"per-position conditional acceptance: [{curve}]  (reached: [{tried}])")
    for w in rep.warnings:
        parts.append("warning: " + w)
    parts.append("crosscheck: OK" if rep.ok else f"crosscheck: {rep.mismatches} prompt(s) with a real mismatch")
    return "\n".join(parts)
