"""The target architectures DSpark users run, as random-weight targets: our loop on llama.cpp's real
graphs and memories for each (``pyllama_dspark.gguf.target_writer``).

Per architecture (llama, qwen3, qwen3moe, gemma4, gemma4-moe, gpt-oss; 4096-token vocabularies,
F32 weights), three prompts x ``N_GEN`` tokens against plain greedy decoding of the same file
through llama-cpp-python's ``Llama`` (an independent path):

* a random DSpark draft (``make_test_draft --target``), through ``Speculator``;
* the oracle with planted errors: partial acceptance at every block position, so the rejected
  tails are removed from the target's memory all the time -- on the sliding-window caches of
  gemma4 / gpt-oss too, which run here as llama-server runs them (``swa_full`` off, an SWA cache of
  n_swa + n_ubatch cells padded to 256) and long enough that the SWA ring wraps;
* C++ parity (slow; every arch but llama, which test_parity_cpp.py covers; two prompts):
  llama-server built from the same llama.cpp, same files and settings, same tokens and per-step
  (drafted, accepted) counts, with the random draft and a bigram draft.

A divergence is diagnosed: the target's top-2 logit margin at that point (below ``TIE_EPS``: a
numerical near-tie, counted and printed; otherwise a bug) and, for MoE targets, the router margin
llama.cpp computed there.  Also: MoE routers have clear margins (and the diagnostic sees small ones
when the router is made random-like), ``--peaked`` scales the logits, gemma3 is refused with a
Python exception (no abort), and one Gemma 4 target at its real 262,144-token vocabulary.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from greedy_ref import first_divergence, greedy, top2_margin
from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.speculative.oracle import OracleProposer
from pyllama_dspark.prompts import load_prompts
from pyllama_dspark.gguf.router_margins import router_margins
from pyllama_dspark.gguf.target_archs import ARCH_SPECS
from pyllama_dspark.gguf.target_writer import make_test_target
from pyllama_dspark.gguf.testing import make_test_draft, plant_markov_bigrams

ARCHS = ("llama", "qwen3", "qwen3moe", "gemma4", "gemma4-moe", "gpt-oss")
N_VOCAB = 4096
N_PROMPT = 40          # prompt tokens (truncated benchmark prompts)
N_GEN = 232            # 40 + 232 > 256: the SWA cache (pad(n_swa 32 + n_ubatch 64, 256) cells) wraps
N_GEN_RANDOM = 96     # a random draft accepts ~nothing: one cycle per token
N_BATCH = 64
N_CTX = 1024
N_SWA = 32             # make_test_target's default sliding window
THREADS = 1            # lossless comparisons against Llama greedy on random targets, as validated
TIE_EPS = 1e-3
SETTINGS = dict(n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH, n_threads=THREADS, flash_attn="auto")


def speculator(target, draft=None, **kw) -> Speculator:
    """Our loop verifying every drafted token (llama.cpp's fixed block, as llama-server does)."""
    if "schedule" in inspect.signature(Speculator).parameters:
        kw.setdefault("schedule", "off")
    return Speculator(target, draft, **SETTINGS, **kw)


def open_ref(target):
    from llama_cpp import Llama

    return Llama(model_path=str(target), n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH, n_threads=THREADS,
                 n_threads_batch=THREADS, flash_attn=True, verbose=False)


def batch_shape_noise(target, tokens, rows: int = 8, skip: int = N_PROMPT) -> float:
    """Max |logit difference| between decoding ``tokens`` one row at a time and ``rows`` rows at a
    time (after the first ``skip`` tokens, decoded together either way): how far llama.cpp's own
    logits for the same prefix move with the batch shape on this target."""
    from llama_cpp import llama_cpp as ll

    def all_rows(step):
        model = ll.llama_model_load_from_file(str(target).encode(), ll.llama_model_default_params())
        cp = ll.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = N_CTX, N_BATCH, N_BATCH
        cp.n_threads = cp.n_threads_batch = THREADS
        cp.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
        ctx = ll.llama_init_from_model(model, cp)
        nv = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
        out, i = [], 0
        while i < len(tokens):
            n = min(skip if i == 0 else step, len(tokens) - i)
            b = ll.llama_batch_init(n, 0, 1)
            for j in range(n):
                b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = tokens[i + j], i + j, 1, 1
                b.seq_id[j][0] = 0
            b.n_tokens = n
            rc = ll.llama_decode(ctx, b)
            ll.llama_batch_free(b)
            assert rc == 0
            out += [np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, j), shape=(nv,)).copy() for j in range(n)]
            i += n
        ll.llama_free(ctx)
        ll.llama_model_free(model)
        return np.array(out[skip:], dtype=np.float64)

    return float(np.abs(all_rows(1) - all_rows(rows)).max())


class Case:
    def __init__(self, arch, target, draft, prompts, refs, llm, noise):
        self.arch, self.target, self.draft, self.prompts, self.refs, self.llm = arch, target, draft, prompts, refs, llm
        self.spec = ARCH_SPECS[arch]
        self.noise = noise
        # a divergence at a top-2 margin below what the batch shape alone moves the logits by is
        # numerical (llama.cpp's own logits flip there), anything else is a bug
        self.tie_eps = max(TIE_EPS, noise)


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tmp_path_factory):
    arch = request.param
    d = tmp_path_factory.mktemp(f"target-{arch}")
    target = make_test_target(d / "target.gguf", arch, n_vocab=N_VOCAB, seed=11, vocab_type="f32")
    draft = make_test_draft(target, d / "draft.gguf", kind="dspark", seed=5)   # make-test-draft --target
    llm = open_ref(target)
    texts = [it.turns[0] for it in load_prompts(limit_per_file=1)][:3]
    prompts = [llm.tokenize(t.encode(), add_bos=False, special=False)[:N_PROMPT] for t in texts]
    refs = [greedy(llm, p, N_GEN) for p in prompts]
    noise = batch_shape_noise(target, list(prompts[0]) + list(refs[0]))
    print(f"[{arch}] llama.cpp logits, 1-row vs 8-row decodes of the same sequence: max |diff| {noise:.2e}")
    yield Case(arch, str(target), str(draft), prompts, refs, llm, noise)
    llm.close()


MAX_TIES = 4   # per prompt: resumptions after near-tie divergences


def run_lossless(case: Case, run, label: str, n_tokens: int = N_GEN):
    """``run(k, prompt, n)`` -> Done, for each prompt k, against the greedy reference.

    At a divergence the target's top-2 logit margin there (and, for MoE, llama.cpp's router
    margin) is computed; a near-tie (margin < ``case.tie_eps``) is counted and the comparison
    resumes from the reference token (the prompt extended by the reference up to it), anything
    else is a failure.  Returns (stats of every run, near-ties, failures); prints a summary."""
    ties, failures, stats = [], [], []
    for k, (prompt, ref) in enumerate(zip(case.prompts, case.refs)):
        ref = ref[:n_tokens]
        start = 0
        while start < len(ref):
            done = run(k, list(prompt) + list(ref[:start]), len(ref) - start)
            stats.append(done.stats)
            ours, want = list(done.tokens), list(ref[start:])
            i = first_divergence(ours, want)
            if i < 0:
                break
            prefix = list(prompt) + list(ref[:start + i])
            margin = top2_margin(case.llm, prefix)
            what = (f"{case.arch} {label} prompt {k}: divergence at generated token {start + i} "
                    f"(ours {ours[i] if i < len(ours) else None}, target {want[i] if i < len(want) else None}), "
                    f"target top-2 logit margin {margin:.2e} (near-tie threshold {case.tie_eps:.1e})")
            if case.spec.moe and i < len(want):
                rm = router_margins(case.target, prefix + [want[i]], n_threads=THREADS)
                what += f", router margin there {min(float(v[-1]) for v in rm.values()):.2f}"
            if margin >= case.tie_eps or len([t for t in ties if f"prompt {k}:" in t]) >= MAX_TIES:
                failures.append(what)
                break
            ties.append(what)
            start += i + 1
    print(f"[{case.arch}] {label}: {len(case.prompts)} prompts, {sum(len(r[:n_tokens]) for r in case.refs)} reference tokens, "
          f"{len(ties)} near-tie divergences, {len(failures)} real divergences, "
          f"drafted {sum(s.drafted for s in stats)}, accepted {sum(s.accepted for s in stats)}")
    for t in ties:
        print("  near-tie:", t)
    return stats, ties, failures


def test_lossless_random_draft(case):
    with speculator(case.target, case.draft) as sp:
        stats, _, failures = run_lossless(case, lambda k, p, n: sp.generate(p, n), "random DSpark draft",
                                          n_tokens=N_GEN_RANDOM)
    assert not failures, "\n".join(failures)
    assert sum(s.drafted for s in stats) > 0


def test_lossless_oracle_partial_acceptance(case):
    with speculator(case.target) as sp:
        def run(k, prompt, n):
            full = list(case.prompts[k]) + list(case.refs[k])
            sp.decoder.proposer = OracleProposer(full, N_VOCAB, block_size=7, p_error=0.7, seed=len(prompt))
            return sp.generate(prompt, n)

        stats, _, failures = run_lossless(case, run, "oracle (planted errors)")
    assert not failures, "\n".join(failures)
    partial = sum(1 for st in stats for dn, a in zip(st.verify_lengths, st.cycle_accepted) if 0 < a < dn)
    accepted = sum(st.accepted for st in stats)
    print(f"[{case.arch}] oracle: partially accepted blocks {partial}")
    assert partial >= 10 and accepted > 0.3 * sum(map(len, case.refs))
    if case.spec.swa:
        cells = -(-min(N_CTX, N_SWA + N_BATCH) // 256) * 256
        assert max(len(p) + len(r) for p, r in zip(case.prompts, case.refs)) > cells, "the SWA ring never wrapped"
    if case.spec.moe:
        check_router_margins(case)


def check_router_margins(case: Case):
    """Deterministic routing: every token's chosen experts lead the others by > 1 logit."""
    toks = list(case.prompts[0]) + list(case.refs[0])
    rm = router_margins(case.target, toks, n_threads=THREADS)
    lows = {il: float(v.min()) for il, v in rm.items()}
    print(f"[{case.arch}] router margin (last chosen - best unchosen logit), min per layer: "
          + ", ".join(f"{il}: {m:.2f}" for il, m in lows.items()))
    assert len(rm) == case.spec.n_layer
    assert min(lows.values()) > 1.0


def test_router_margin_diagnostic_sees_small_margins(tmp_path):
    """Negative control: a router with a tiny gain puts experts within rounding of each other."""
    t = make_test_target(tmp_path / "flat.gguf", "qwen3moe", n_vocab=1024, seed=2, router_gain=1e-4, vocab_type="f32")
    rm = router_margins(t, list(range(100, 140)), n_threads=THREADS)
    assert max(float(v.max()) for v in rm.values()) < 1e-3


# ---- C++ parity ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server_binary():
    from pyllama_dspark.upstream.llama_server_build import ensure_llama_server

    return ensure_llama_server()


# llama itself is covered by test_parity_cpp.py on SmolLM2
@pytest.mark.slow
@pytest.mark.parametrize("case", [a for a in ARCHS if a != "llama"], indirect=True)
def test_parity_llama_server(case, server_binary, tmp_path):
    from pyllama_dspark.upstream.llama_server import LlamaServer

    bigram = make_test_draft(case.target, tmp_path / "bigram.gguf", kind="dspark", markov_rank=256, seed=3)
    assert plant_markov_bigrams(bigram, [list(p) + list(r) for p, r in zip(case.prompts, case.refs)],
                                drop_every=4) > 20
    mismatches, rows = [], []
    # the random draft accepts ~nothing (one cycle per token): fewer tokens; the bigram one wraps the SWA ring
    for label, draft, n_gen in (("random", case.draft, N_GEN_RANDOM), ("bigram", str(bigram), N_GEN)):
        with LlamaServer(server_binary, case.target, draft, spec_type="draft-dspark", n_max=7, ctx=N_CTX,
                         threads=THREADS, n_batch=N_BATCH, n_ubatch=N_BATCH, flash_attn="auto") as srv, \
                speculator(case.target, draft, n_max=7) as sp:
            for k, p in enumerate(case.prompts[:2]):
                cpp = srv.complete(p, n_gen)
                ours = sp.generate(p, n_gen)
                t = cpp["timings"]
                c_steps = [(s[0], s[1]) for s in cpp["steps"]]
                o_steps = [(dn, a) for dn, a in zip(ours.stats.verify_lengths, ours.stats.cycle_accepted) if dn > 0]
                row = (label, k, cpp["tokens"] == list(ours.tokens), (t.get("draft_n", 0), t.get("draft_n_accepted", 0)),
                       (ours.stats.drafted, ours.stats.accepted), c_steps == o_steps)
                rows.append(row)
                if not (row[2] and row[3] == row[4] and row[5]):
                    i = first_divergence(list(ours.tokens), cpp["tokens"])
                    mismatches.append(f"{case.arch} {row}: first token divergence at {i}\n"
                                      f"  cpp steps  {c_steps[:20]}\n  ours steps {o_steps[:20]}")
    for r in rows:
        print(f"[{case.arch}] parity {r[0]} prompt {r[1]}: tokens equal {r[2]}, cpp (drafted, accepted) {r[3]}, "
              f"ours {r[4]}, steps equal {r[5]}")
    assert not mismatches, "\n".join(mismatches)
    assert sum(r[4][1] for r in rows if r[0] == "bigram") > 20
    assert any(0 < r[4][1] < r[4][0] for r in rows if r[0] == "bigram")


# ---- the rest -----------------------------------------------------------------------------------

def test_peaked_scales_the_logits(tmp_path):
    rows = []
    for peaked in (None, 4.0):
        t = make_test_target(tmp_path / f"p{peaked}.gguf", "qwen3", n_vocab=2048, seed=1, peaked=peaked,
                             vocab_type="f32")
        llm = open_ref(t)
        llm.eval(list(range(300, 320)))
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        rows.append(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float64).copy())
        llm.close()
    ratio = rows[1].std() / rows[0].std()
    print(f"peaked=4 logits std / default: {ratio:.3f}")
    assert abs(ratio - 4.0) < 1e-3
    assert np.argmax(rows[0]) == np.argmax(rows[1])


def test_cli_make_test_target_and_draft(tmp_path):
    from click.testing import CliRunner

    from pyllama_dspark.cli.main import main

    t, d = tmp_path / "g4.gguf", tmp_path / "g4-draft.gguf"
    r = CliRunner().invoke(main, ["make-test-target", "--arch", "gemma4", "-o", str(t), "--n-vocab", "1000",
                                  "--seed", "3", "--peaked", "2"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["make-test-draft", "--target", str(t), "-o", str(d)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["inspect", str(d), "--target", str(t)])
    assert r.exit_code == 0 and "compatible" in r.output, r.output
    r = CliRunner().invoke(main, ["make-test-target", "--arch", "gemma4", "-o", str(t), "--n-vocab", "10"])
    assert r.exit_code != 0 and "n_vocab must be" in r.output


GEMMA3_SCRIPT = textwrap.dedent("""
    import sys
    from pyllama_dspark.decode.api import Speculator
    from pyllama_dspark.errors import UnsupportedArchError
    from pyllama_dspark.gguf.target_writer import make_test_target
    from pyllama_dspark.gguf.testing import make_test_draft
    d = sys.argv[1]
    t = make_test_target(d + "/g3.gguf", "gemma3", n_vocab=1024, seed=1)
    dr = make_test_draft(t, d + "/g3-draft.gguf")
    try:
        Speculator(t, dr, n_ctx=512, n_threads=1)
    except UnsupportedArchError as e:
        print("REFUSED:", e)
    else:
        print("NOT REFUSED")
    from llama_cpp import Llama
    from pyllama_dspark.integrations.llama_plugin import DSparkDraftModel
    llm = Llama(model_path=t, n_ctx=512, n_threads=1, verbose=False)
    try:
        DSparkDraftModel(llm, dr)
    except UnsupportedArchError as e:
        print("PLUGIN REFUSED:", e)
    else:
        print("PLUGIN NOT REFUSED")
    print("LLAMA ALONE:", len(llm.create_completion("Hello", max_tokens=4, temperature=0)["choices"][0]["text"]) >= 0)
    llm.close()
    with Speculator(t, n_ctx=512, n_threads=1) as sp:          # the target alone runs
        print("ALONE:", len(sp.generate([300, 301, 302], 8).tokens))
""")


def test_gemma3_target_is_refused_cleanly(tmp_path):
    r = subprocess.run([sys.executable, "-c", GEMMA3_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                       timeout=300)
    print(r.stdout)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "REFUSED: " in r.stdout and "'gemma3' cannot expose layer inputs" in r.stdout
    assert "PLUGIN REFUSED:" in r.stdout
    assert "ALONE: 8" in r.stdout


def test_gemma4_at_its_real_vocabulary(tmp_path):
    """262,144 tokens (F16 embedding / output matrices, the CLI default): llama.cpp loads the padded
    tokenizer, and the loop stays lossless on it."""
    t = make_test_target(tmp_path / "g4-262k.gguf", "gemma4", seed=4)
    d = make_test_draft(t, tmp_path / "g4-262k-draft.gguf", seed=4)
    llm = open_ref(t)
    assert llm.n_vocab() == 262144
    assert llm.detokenize([262143]) == b"<extra_262143>"
    prompt = llm.tokenize(b"Explain the Pythagorean theorem in one sentence.", add_bos=False)
    ref = greedy(llm, prompt, 24)
    llm.close()
    with speculator(t, d) as sp:
        assert sp.target.n_vocab == 262144
        done = sp.generate(prompt, 24)
    assert list(done.tokens) == ref


def test_reuse_prefix_after_the_swa_ring_wrapped(tmp_path):
    """With ``swa_full`` off (llama-server's default, ours), positions older than the window get
    overwritten; a ``reuse_prefix`` that goes back further than that decodes the prompt again (as
    llama-server does) instead of attending to missing cells."""
    t = make_test_target(tmp_path / "g4.gguf", "gemma4", n_vocab=2048, seed=11, vocab_type="f32")
    llm = open_ref(t)
    p1 = list(range(300, 340))
    ref1 = greedy(llm, p1, 400)                          # 440 positions: the 256-cell SWA ring wrapped
    with speculator(t) as sp:
        got1 = list(sp.generate(p1, 400, reuse_prefix=True).tokens)
        i = first_divergence(got1, ref1)
        if i >= 0:   # only at a numerical near-tie (seen at token 266 on an AVX2-only machine)
            margin = top2_margin(llm, p1 + ref1[:i])
            assert margin < TIE_EPS, f"real divergence at generated token {i}: top-2 margin {margin:.5f}"
            warnings.warn(f"SWA reuse: 1 numerical near-tie excused at generated token {i} (top-2 margin {margin:.5f})")
        # the references follow what the memory holds (ours, equal to ref1 up to any near-tie)
        p2 = (p1 + got1)[:100] + [777, 778]              # shares 100 tokens with what the memory holds
        ref2, ref3, ref4 = greedy(llm, p2, 32), greedy(llm, p1, 32), greedy(llm, p1 + got1[:300], 100)
        assert list(sp.generate(p1, 32, reuse_prefix=True).tokens) == ref3     # the same prompt again
        assert list(sp.generate(p1 + got1[:300], 100, reuse_prefix=True).tokens) == ref4
        assert list(sp.generate(p2, 32, reuse_prefix=True).tokens) == ref2     # back to position 100
    llm.close()
