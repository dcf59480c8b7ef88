"""T > 0 end to end with real blocks: the joint law of the first three tokens, n_max = 7.

The shipped reduced-vocabulary drafter (F16, d2t) drafts whole blocks of 7 (the Markov head
conditioned on each drawn token); the first three emitted tokens (t1 sampled after the prompt,
t2 and t3 out of the first block's accept / resample / next cycle) must follow the law plain
sampling from the target gives them.  The reference is exact and independent of our code:
``llama_cpp.Llama`` logits after the prompt and after every reachable prefix, through llama.cpp's
own sampler chain (``llama_sampler_*``; :mod:`block_law`).  A sharp chain (top-k 4, T 0.8) keeps
the law to ~64 outcomes.

Three front ends, one test each: the single-sequence engine (``Speculator``), the batched decoder
(``BatchDecoder``: three slots, two prompts interleaved, so rows of different requests share one
draft and one target decode) and ``serve`` (continuous batching, ``-np 2``, two clients at once;
text only, so outcomes whose texts are prefixes of one another share a cell).

Each test: a chi-square goodness-of-fit must not reject (p > 1e-4 per prompt, p > 1e-3 combined
over the prompts; the samples are fixed, so these are fixed draws, not flaky), the samples must
stay on the law's support, both paths of the rule must occur at block positions 1 and 2 (drafts
accepted and rejected), and the same samples tested against a deliberately wrong law (the same
chain at temperature 1.2; chi-square combined over the prompts) must be rejected (p < 1e-4): the
negative control.  Seeds are fixed (seed0 + i), so every run draws the same samples.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest

import pyllama_dspark
from block_law import cell_of_text, chi2_cells, chi2_law, exact_law, text_law
from greedy_ref import open_llama, TEST_THREADS
from pyllama_dspark.speculative.sampling_params import SamplingParams
from test_sampling_rule import chi2_sf

THREADS = TEST_THREADS
N_MAX = 7
DEPTH = 3
PARAMS = SamplingParams(temperature=0.8, top_k=4, top_p=1.0, min_p=0.0)
WRONG = replace(PARAMS, temperature=1.2)     # the negative control's law
# chat prompts (SmolLM2's ChatML, no system prompt: short prefills) where the shipped drafter's
# first block is accepted at positions 1 and 2 about half the time, and the law spreads over many
# outcomes
QUESTIONS = ["What is 12 times 7?", "What is 7 plus 8?"]
PROMPTS = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in QUESTIONS]
# samples per prompt: the engine and the batched decoder; serve (a 9-token completion each) half
N = int(os.environ.get("PYLLAMA_DSPARK_BLOCK_SAMPLES", "200"))
N_SERVE = N // 2
P_OK, P_OK_EACH, P_REJECT = 1e-3, 1e-4, 1e-4


def _name(prompt: str) -> str:
    return QUESTIONS[PROMPTS.index(prompt)] if prompt in PROMPTS else prompt


def shipped_draft() -> str:
    path = os.path.join(os.path.dirname(pyllama_dspark.__file__), "data", "SmolLM2-135M-Instruct-DSpark.gguf")
    assert os.path.isfile(path), path
    return path


@pytest.fixture(scope="module")
def laws(target_path):
    """prompt -> (tokens, exact law, wrong law, text piece per token of either law: b"" for an
    end-of-generation token, which ends a completion without adding text)."""
    from llama_cpp import llama_cpp as ll

    llm = open_llama(target_path)
    out = {}
    try:
        vocab = ll.llama_model_get_vocab(llm.model)
        for text in PROMPTS:
            toks = llm.tokenize(text.encode(), add_bos=False, special=True)
            law = exact_law(llm, toks, PARAMS, DEPTH)
            wrong = exact_law(llm, toks, WRONG, DEPTH)
            ids = {t for k in list(law) + list(wrong) for t in k}
            pieces = {t: b"" if ll.llama_vocab_is_eog(vocab, t) else llm.detokenize([t]) for t in ids}
            out[text] = (toks, law, wrong, pieces)
    finally:
        llm.close()
    return out


def _check(name, samples_by_prompt, laws, block_stats):
    """Chi-square per prompt against the exact law (must pass) and the wrong law (must reject)."""
    lines, ok, fit, wrong_fit = [], [], [], []
    for text, samples in samples_by_prompt.items():
        _, law, wrong, _ = laws[text]
        st, dof, p, tv, outside = chi2_law(samples, law)
        wst, wdof, wp, wtv, wout = chi2_law(samples, wrong)
        lines.append(f"{_name(text)!r}: {len(samples)} samples, {len(law)} outcomes; exact law chi2 {st:.1f} dof {dof} "
                     f"p {p:.3g} TV {tv:.3f} outside {outside}; wrong law (T {WRONG.temperature}) chi2 {wst:.1f} "
                     f"dof {wdof} p {wp:.3g}")
        ok.append(outside == 0 and p > P_OK_EACH)
        fit.append((st, dof))
        wrong_fit.append((wst, wdof))
    ok.append(_combined_p(fit, lines, "exact law") > P_OK)
    rejected = _combined_p(wrong_fit, lines, "negative control") < P_REJECT
    report = f"\n{name}: " + "; ".join(f"{_name(k)} {v}" for k, v in block_stats.items()) + "\n" + "\n".join(lines)
    print(report)
    return ok, rejected, report


def _combined_p(fits, lines, what) -> float:
    stat, dof = sum(f[0] for f in fits), sum(f[1] for f in fits)
    p = chi2_sf(stat, dof)
    lines.append(f"{what}, combined over the prompts: chi2 {stat:.1f} dof {dof} p {p:.3g}")
    return p


class _BlockRecorder:
    """Wraps a proposer; keeps the drafts of its last T > 0 block proposal."""

    def __init__(self, inner):
        self.inner = inner
        self.last = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose_sampled(self, *args, **kw):
        prop = self.inner.propose_sampled(*args, **kw)
        if self.last is None:
            self.last = [int(t) for t in prop.tokens]
        return prop


def _first_block_stats(samples, blocks):
    """How often the first block's drafts 1 and 2 were accepted / rejected (t2 == d1: accepted,
    since a rejected draft has zero residual mass), and the block lengths."""
    acc1 = sum(1 for s, d in zip(samples, blocks) if len(s) > 1 and s[1] == d[0])
    acc2 = sum(1 for s, d in zip(samples, blocks) if len(s) > 2 and s[1] == d[0] and s[2] == d[1])
    return {"block lengths": sorted({len(d) for d in blocks}), "draft 1 accepted": f"{acc1}/{len(samples)}",
            "draft 2 accepted": f"{acc2}/{acc1}"}, acc1, acc2


def test_block_law_single_sequence_engine(target_path, laws):
    from pyllama_dspark.decode.api import Speculator

    samples_by_prompt, stats = {}, {}
    with Speculator(target_path, shipped_draft(), n_threads=THREADS, n_ctx=512, n_max=N_MAX, schedule="off") as sp:
        rec = sp.decoder.proposer = _BlockRecorder(sp.decoder.proposer)
        for j, text in enumerate(PROMPTS):
            toks = laws[text][0]
            samples, blocks = [], []
            for i in range(N):
                rec.last = None
                it = sp.stream(toks, 16, sampling=PARAMS.with_seed(1000 * j + i), reuse_prefix=True)
                got = []
                for ev in it:
                    got += ev.tokens
                    if len(got) >= DEPTH:
                        break
                it.close()
                samples.append(tuple(got[:DEPTH]))
                blocks.append(rec.last)
            samples_by_prompt[text] = samples
            stats[text] = _first_block_stats(samples, blocks)
    info = {t: s[0] for t, s in stats.items()}
    ok, rejected, report = _check("single-sequence engine", samples_by_prompt, laws, info)
    assert all(s[0]["block lengths"] == [N_MAX] for s in stats.values()), report
    assert all(0 < s[1] < N and 0 < s[2] < s[1] for s in stats.values()), "both paths at positions 1, 2" + report
    assert all(ok), report
    assert rejected, "the negative control was not rejected" + report


def test_block_law_batched_decoder(target_path, laws):
    from pyllama_dspark.decode.loop import Decoder
    from pyllama_dspark.decode.cycle import Chunk
    from pyllama_dspark.llama.draft_meta import read_draft_meta
    from pyllama_dspark.llama.handles import ContextSettings, Draft, Target
    from pyllama_dspark.speculative.policy import VerifyPolicy

    n_seq = 3
    draft = shipped_draft()
    meta = read_draft_meta(draft)
    s = ContextSettings(n_ctx=512 * n_seq, n_threads=THREADS, n_seq_max=n_seq)   # fixed block below
    got, owner = {}, {}
    with Target(target_path, s, capture_layers=meta.target_layers) as t:
        d = Draft(draft, t, s)
        bd = Decoder(t, d, n_max=N_MAX, policy=VerifyPolicy(mode="off"), streaming=True)
        for i in range(N):          # the prompts interleaved: each batch mixes requests of both
            for j, text in enumerate(PROMPTS):
                rid = bd.submit(laws[text][0], 16, sampling=PARAMS.with_seed(50000 + 1000 * j + i))
                got[rid], owner[rid] = [], text
        steps_of = {}
        while bd.pending():
            bd.step()
            for rid, ev in bd.poll():
                # Chunks carry each step's tokens (the last one before Done included)
                if isinstance(ev, Chunk) and len(got[rid]) < DEPTH:
                    got[rid] += ev.tokens
                    steps_of.setdefault(rid, []).append(len(ev.tokens))
                    if len(got[rid]) >= DEPTH:
                        bd.cancel(rid)      # the rest of its generation is not needed (False once done)
        shared = max(bd.verify_batches)
    samples_by_prompt = {text: [tuple(got[r][:DEPTH]) for r in got if owner[r] == text] for text in PROMPTS}
    # the admitting step emits t1 alone (the prefill's token, streamed at once); the first cycle
    # then emits the first block's accepted drafts + one token
    first = [steps_of[r][0] for r in got]
    cycle1 = [steps_of[r][1] for r in got]
    full = sum(1 for n in cycle1 if n >= 2)       # an accepted draft, then at least one more
    info = {"first-cycle tokens histogram": np.bincount(cycle1).tolist(), "largest verify batch": shared}
    ok, rejected, report = _check("batched decoder (3 slots)", samples_by_prompt, laws, info)
    assert shared > N_MAX + 1, "rows of several requests verified in one decode" + report
    assert set(first) == {1}, "the prefill's token streamed alone" + report
    assert 0 < full < len(cycle1) and min(cycle1) == 1, "accepted and rejected first drafts" + report
    assert all(ok), report
    assert rejected, "the negative control was not rejected" + report


def test_block_law_through_serve(target_path, laws, tmp_path):
    from serve_helpers import ServeProcess

    # max_tokens 9: the first cycle after t1 drafts a full block of 7 (llama-server's limit keeps
    # max_tokens - emitted - 1 drafts)
    n_tok = N_MAX + 2
    cells = {text: text_law(laws[text][1], laws[text][3].__getitem__) for text in PROMPTS}
    wrong_cells = {text: text_law(laws[text][2], laws[text][3].__getitem__) for text in PROMPTS}
    srv = ServeProcess(target_path, shipped_draft(), tmp_path / "serve.log", n_slots=2, n_ctx=512,
                       extra=["--spec-draft-n-max", str(N_MAX), "--schedule", "off", "-t", str(THREADS)])
    try:
        def one(job):
            text, seed = job
            r = srv.post("/v1/completions", {"prompt": laws[text][0], "max_tokens": n_tok, "temperature": PARAMS.temperature,
                                             "top_k": PARAMS.top_k, "top_p": PARAMS.top_p, "min_p": PARAMS.min_p,
                                             "seed": seed})
            assert r.status_code == 200, r.text
            body = r.json()
            return text, body["choices"][0]["text"], body["timings"]

        jobs = [(text, 90000 + 1000 * j + i) for i in range(N_SERVE) for j, text in enumerate(PROMPTS)]
        with ThreadPoolExecutor(2) as ex:
            results = list(ex.map(one, jobs))
        log = srv.log_text()
    finally:
        srv.stop()
    lines, ok, fit, wrong_fit = [], [], [], []
    drafted = sum(t.get("draft_n", 0) for _, _, t in results)
    accepted = sum(t.get("draft_n_accepted", 0) for _, _, t in results)
    for text in PROMPTS:
        outs = [o for tx, o, _ in results if tx == text]
        res = []
        for law_cells in (cells[text], wrong_cells[text]):
            cell_of, probs, _, texts = law_cells
            idx = [cell_of_text(o, cell_of, texts) for o in outs]
            counts = np.bincount([i for i in idx if i >= 0], minlength=len(probs))
            res.append(chi2_cells(counts, probs, outside=sum(1 for i in idx if i < 0)) + (sum(1 for i in idx if i < 0),))
        (st, dof, p, tv, outside), (wst, wdof, wp, _, _) = res
        lines.append(f"{_name(text)!r}: {len(outs)} completions, {len(cells[text][1])} text cells; exact law chi2 {st:.1f} "
                     f"dof {dof} p {p:.3g} TV {tv:.3f} outside {outside}; wrong law chi2 {wst:.1f} dof {wdof} p {wp:.3g}")
        ok.append(outside == 0 and p > P_OK_EACH)
        fit.append((st, dof))
        wrong_fit.append((wst, wdof))
    ok.append(_combined_p(fit, lines, "exact law") > P_OK)
    rejected = _combined_p(wrong_fit, lines, "negative control") < P_REJECT
    report = f"\nserve -np 2: drafted {drafted}, accepted {accepted}\n" + "\n".join(lines)
    print(report)
    assert "Traceback" not in log, log[-3000:]
    assert 0 < accepted < drafted and drafted >= N_MAX * len(results), "real blocks, partly accepted" + report
    assert all(ok), report
    assert rejected, "the negative control was not rejected" + report
