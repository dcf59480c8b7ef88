"""Parity with llama.cpp's own C++ DSpark driver (llama-server built from the same llama.cpp commit).

Same target, same draft GGUF, same settings (n_ctx 4096, n_batch 512, flash attention auto,
--spec-draft-n-max 7, greedy): the Python loop must produce the same tokens, the same
drafted/accepted totals (llama-server's ``timings``) and the same per-step (drafted, accepted)
sequence (its LLAMA_TRACE log).  Drafts: a random DSpark draft (exercises the draft-length
rules; accepts ~nothing), F32 as the tests' fixture and BF16 / Q8_0 / Q4_0 as ``-md random`` /
``make-test-draft --type`` write it (BF16 also with planted bigrams); the same draft with target bigrams planted in its Markov head, so
llama.cpp's in-graph Markov chain proposes real continuations with partial acceptances; the
shipped trained drafter (F16 weights, reduced vocabulary through its d2t table); DFlash drafts
(``--spec-type draft-dflash``: a random DFlash draft, and the shipped drafter's DFlash mode, its
Markov / confidence heads removed, as ``serve --spec-type draft-dflash`` runs it); and the shipped
drafter with a confidence threshold, our static schedule (``--conf-min``) against llama.cpp's
``--spec-draft-p-min``, which common/speculative.cpp applies to DSpark drafts the same way (the
block ends at the first drafted position whose confidence is below it).

Our side always pins its verification schedule (the fixed block, or the static cut): llama-server
has no other.
"""

from __future__ import annotations

import os

import pytest

from greedy_ref import TEST_THREADS

import pyllama_dspark
from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.drafts.dflash_mode import dflash_mode_draft
from pyllama_dspark.upstream.llama_server import LlamaServer
from pyllama_dspark.upstream.llama_server_build import ensure_llama_server
from pyllama_dspark.speculative.policy import VerifyPolicy
from pyllama_dspark.prompts import load_prompts
from pyllama_dspark.gguf.draft_types import DEFAULT_DRAFT_TYPE
from pyllama_dspark.gguf.testing import make_test_draft, plant_markov_bigrams

pytestmark = pytest.mark.slow

N_PREDICT = 64
THREADS = TEST_THREADS


@pytest.fixture(scope="module")
def server_binary():
    return ensure_llama_server()


@pytest.fixture(scope="module")
def prompts(target_path):
    items = load_prompts(limit_per_file=1)  # one prompt from each of the five sets
    with Speculator(target_path, n_threads=THREADS) as sp:
        toks = [sp.chat_prompt([{"role": "user", "content": it.turns[0]}]).tokens for it in items]
        refs = [sp.generate(t, N_PREDICT).tokens for t in toks]
    return [(f"{it.source}#{it.index}", t, r) for it, t, r in zip(items, toks, refs)]


@pytest.fixture(scope="module")
def bigram_draft(target_path, prompts, tmp_path_factory):
    path = tmp_path_factory.mktemp("parity") / "bigram-dspark.gguf"
    make_test_draft(target_path, path, kind="dspark", markov_rank=256, seed=3)
    used = plant_markov_bigrams(path, [list(p) + list(r) for _, p, r in prompts], drop_every=4)
    assert used > 20
    return str(path)


def shipped_draft() -> str:
    path = os.path.join(os.path.dirname(pyllama_dspark.__file__), "data", "SmolLM2-135M-Instruct-DSpark.gguf")
    assert os.path.isfile(path), path
    return path


def _compare(target_path, draft, prompts, binary, min_accepted, *, spec_type="draft-dspark", p_min=None,
             n_predict=N_PREDICT):
    """Same tokens, totals and per-step counts.  ``p_min``: llama-server's --spec-draft-p-min and
    our static schedule with that conf_min; otherwise our fixed block (schedule "off")."""
    rows, mismatches = [], []
    schedule = "off" if p_min is None else VerifyPolicy(mode="static", conf_min=p_min)
    with LlamaServer(binary, target_path, draft, spec_type=spec_type, n_max=7, p_min=p_min, ctx=4096, threads=THREADS,
                     n_batch=512, n_ubatch=512, flash_attn="auto") as srv, \
            Speculator(target_path, draft, n_ctx=4096, n_batch=512, n_threads=THREADS, flash_attn="auto",
                       n_max=7, schedule=schedule) as sp:
        assert sp.decoder.policy is None or sp.decoder.policy.mode == "static"
        for name, prompt, _ in prompts:
            cpp = srv.complete(prompt, n_predict)
            ours = sp.generate(prompt, n_predict)
            t = cpp["timings"]
            c_steps = [(s[0], s[1]) for s in cpp["steps"]]
            o_steps = [(d, a) for d, a in zip(ours.stats.verify_lengths, ours.stats.cycle_accepted) if d > 0]
            row = dict(prompt=name, tokens_equal=cpp["tokens"] == ours.tokens, o_steps=o_steps,
                       cpp=(t.get("draft_n", 0), t.get("draft_n_accepted", 0)),
                       ours=(ours.stats.drafted, ours.stats.accepted), steps_equal=c_steps == o_steps,
                       cpp_tps=t.get("predicted_per_second"), ours_tps=ours.stats.tokens_per_second)
            rows.append(row)
            if not (row["tokens_equal"] and row["cpp"] == row["ours"] and row["steps_equal"]):
                mismatches.append(f"{row}\n  cpp steps  {c_steps}\n  ours steps {o_steps}\n"
                                  f"  cpp tokens  {cpp['tokens']}\n  ours tokens {ours.tokens}")
    for r in rows:
        print({k: v for k, v in r.items() if k != "o_steps"})
    assert not mismatches, "\n".join(mismatches)
    assert sum(r["ours"][1] for r in rows) >= min_accepted
    return rows


def test_random_draft_matches_llama_server(target_path, dspark_draft_path, prompts, server_binary):
    """The all-rejections path (a random draft is almost never right) on two prompts, 32 tokens
    each (one cycle per token, every cycle alike; the blocks cut short by the budget at the end
    included); the bigram draft below runs all five with acceptances."""
    rows = _compare(target_path, dspark_draft_path, prompts[:2], server_binary, min_accepted=0, n_predict=32)
    assert sum(r["ours"][0] for r in rows) > 0


def test_bigram_draft_matches_llama_server(target_path, bigram_draft, prompts, server_binary):
    rows = _compare(target_path, bigram_draft, prompts, server_binary, min_accepted=20, n_predict=48)
    # partial acceptances happened: some steps accepted part of a block
    assert any(0 < r["ours"][1] < r["ours"][0] for r in rows)


# ---- the shipped drafter, DFlash drafts, the confidence threshold: 3 prompts x 48 tokens each ------

N_SHORT = 48


def test_shipped_drafter_matches_llama_server(target_path, prompts, server_binary):
    """F16 weights, reduced vocabulary (d2t): draft ids mapped to target ids on both sides."""
    rows = _compare(target_path, shipped_draft(), prompts[:3], server_binary, min_accepted=20, n_predict=N_SHORT)
    assert any(0 < r["ours"][1] < r["ours"][0] for r in rows)


def test_dflash_drafts_match_llama_server(target_path, dflash_draft_path, prompts, server_binary):
    """--spec-type draft-dflash: block [anchor, mask x (block_size - 1)], drafts read from rows
    1.. (both sides clamp --spec-draft-n-max 7 to block_size - 1 = 6).  A random DFlash draft (the
    draft-length rules) and the shipped drafter's DFlash mode (partial acceptances)."""
    rows = _compare(target_path, dflash_draft_path, prompts[:1], server_binary, min_accepted=0,
                    spec_type="draft-dflash", n_predict=32)
    assert sum(r["ours"][0] for r in rows) > 0
    dflash_shipped = dflash_mode_draft(shipped_draft())
    assert dflash_shipped != shipped_draft()
    rows = _compare(target_path, dflash_shipped, prompts[:3], server_binary, min_accepted=10,
                    spec_type="draft-dflash", n_predict=N_SHORT)
    assert any(0 < r["ours"][1] < r["ours"][0] for r in rows)


def test_conf_min_matches_llama_server_p_min(target_path, prompts, server_binary):
    """Our static schedule (--conf-min 0.5) against llama-server's --spec-draft-p-min 0.5 on the
    shipped drafter (it has a confidence head): the same truncated blocks, step by step."""
    rows = _compare(target_path, shipped_draft(), prompts[:3], server_binary, min_accepted=10, p_min=0.5,
                    n_predict=N_SHORT)
    # the threshold cut blocks short (not only the max_tokens limit at each prompt's end) and left
    # some whole
    lengths = [d for r in rows for d, _ in r["o_steps"][:-1]]
    assert any(0 < d < 7 for d in lengths) and 7 in lengths, lengths


def test_bonus_anchor_dspark_through_convert_matches_llama_server(target_path, bigram_draft, prompts, server_binary,
                                                                tmp_path):
    """``sample_from_anchor = false`` (the speculators layout's default: block [anchor, mask x k],
    drafts from rows 1..k), reached the way users get it -- an HF checkpoint through ``convert``:
    the same tokens and per-step counts as llama-server on the same GGUF, and the target's own
    greedy tokens (the prompts' references are plain greedy decoding)."""
    import json

    from pyllama_dspark.gguf.reader import field_value, read_gguf
    from pyllama_dspark.interop.convert import convert_checkpoint
    from pyllama_dspark.interop.export import export_checkpoint

    ck = export_checkpoint(bigram_draft, tmp_path / "ck")
    cfg_path = os.path.join(ck, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["sample_from_anchor"] = False
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    draft = convert_checkpoint(ck, target_path, str(tmp_path / "bonus.gguf"))
    assert field_value(read_gguf(draft), "dflash.sample_from_anchor") is False
    rows = _compare(target_path, draft, prompts[:3], server_binary, min_accepted=1, n_predict=N_SHORT)
    with Speculator(target_path, draft, n_ctx=4096, n_threads=THREADS, n_max=7, schedule="off") as sp:
        assert sp.proposer.offset == 1   # the bonus slot: drafts read from rows 1..
        for name, prompt, ref in prompts[:3]:
            assert list(sp.generate(prompt, N_SHORT).tokens) == list(ref[:N_SHORT]), name
    assert sum(r["ours"][0] for r in rows) > 0


# ---- the test drafts as `-md random` / `make-test-draft` write them: BF16, and the other types ----

@pytest.fixture(scope="module")
def typed_drafts(target_path, prompts, tmp_path_factory):
    """The random DSpark draft of each type (the default, BF16, as ``-md random`` writes it), and a
    BF16 twin of ``bigram_draft`` (same seed and rank, the same bigrams planted in BF16)."""
    d = tmp_path_factory.mktemp("typed")
    out = {wt: make_test_draft(target_path, d / f"random-{wt}.gguf", kind="dspark", weight_type=wt)
           for wt in (DEFAULT_DRAFT_TYPE, "q8_0", "q4_0")}
    out["bigram"] = make_test_draft(target_path, d / "bigram-bf16.gguf", kind="dspark", markov_rank=256, seed=3,
                                    weight_type=DEFAULT_DRAFT_TYPE)
    assert plant_markov_bigrams(out["bigram"], [list(p) + list(r) for _, p, r in prompts], drop_every=4) > 20
    return out


def test_default_type_random_draft_matches_llama_server(target_path, typed_drafts, prompts, server_binary):
    """``-md random``'s draft (BF16): the all-rejections path on two prompts, and the planted
    bigrams (partial acceptances) on three."""
    assert DEFAULT_DRAFT_TYPE == "bf16"
    rows = _compare(target_path, typed_drafts["bf16"], prompts[:2], server_binary, min_accepted=0, n_predict=32)
    assert sum(r["ours"][0] for r in rows) > 0
    rows = _compare(target_path, typed_drafts["bigram"], prompts[:3], server_binary, min_accepted=10,
                    n_predict=N_SHORT)
    assert any(0 < r["ours"][1] < r["ours"][0] for r in rows)


@pytest.mark.parametrize("wt", ["q8_0", "q4_0"])
def test_quantized_random_drafts_match_llama_server(target_path, typed_drafts, prompts, server_binary, wt):
    rows = _compare(target_path, typed_drafts[wt], prompts[:1], server_binary, min_accepted=0, n_predict=32)
    assert sum(r["ours"][0] for r in rows) > 0
