"""T > 0 through the engine, the Python API and the CLI: the target's law, determinism, the greedy
path, prefix reuse.

The law: the first two tokens of a few hundred seeded generations with full 7-token draft blocks
(random DSpark and DFlash drafts) against their exact law under llama.cpp's own sampler chain on
``llama_cpp.Llama``'s logits (tests/first_tokens_law.py), chi-square with a negative control; the
CLI, run with a draft: a degenerate chain (top-k 1 at temperature 1) must give Llama's greedy
tokens, and every token of a hot top-k 3 run must be one of the target's 3 best at its position.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from greedy_ref import TEST_THREADS
from click.testing import CliRunner

from first_tokens_law import law_check, two_token_law
from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.cli.main import main
from pyllama_dspark.speculative.sampling_params import SamplingParams

THREADS = TEST_THREADS
T1 = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05, seed=5)
PROMPT = "Write one sentence about the moon."
CLI_PROMPT = "The moon is"     # raw: Llama's greedy continuation runs 16 tokens without EOS
LAW_PROMPT = "The capital of France is"
LAW_PARAMS = SamplingParams(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)
WRONG_PARAMS = SamplingParams(temperature=2.0, top_k=4, top_p=1.0, min_p=0.0)   # the negative control's law
N_LAW = 240


@pytest.fixture(scope="module")
def laws(llama_refs):
    llm = llama_refs.llm
    prompt = llm.tokenize(LAW_PROMPT.encode(), add_bos=True, special=True)
    return prompt, two_token_law(llm, prompt, LAW_PARAMS), two_token_law(llm, prompt, WRONG_PARAMS)


class _BlockRecorder:
    """Wraps a proposer and records how many drafts each T > 0 proposal was asked for."""

    def __init__(self, inner):
        self.inner, self.asked = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose_sampled(self, anchor, pos0, n_draft, *a, **kw):
        self.asked.append(n_draft)
        return self.inner.propose_sampled(anchor, pos0, n_draft, *a, **kw)


def _first_two(sp, prompt, params, seed):
    """(t1, t2) of one generation: t1 from the prefill row, t2 from a cycle over a 7-token block."""
    got = []
    it = sp.stream(prompt, 9, sampling=params.with_seed(seed), reuse_prefix=True)
    for ev in it:
        got += ev.tokens
        if len(got) >= 2 or (got and sp.target.is_eog(got[0])):
            break
    it.close()
    return tuple(got[:1]) if sp.target.is_eog(got[0]) else tuple(got[:2])


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_first_two_tokens_follow_the_target_law_with_full_blocks(kind, target_path, dspark_draft_path,
                                                                 dflash_draft_path, laws):
    prompt, law, wrong = laws
    draft = dspark_draft_path if kind == "dspark" else dflash_draft_path
    with Speculator(target_path, draft, n_threads=THREADS, n_ctx=512) as s:
        rec = s.decoder.proposer = _BlockRecorder(s.decoder.proposer)
        samples = [_first_two(s, prompt, LAW_PARAMS, 1000 + i) for i in range(N_LAW)]
    full = 7 if kind == "dspark" else 6
    assert rec.asked and all(n == full for n in rec.asked), f"not full blocks: {sorted(set(rec.asked))}"
    law_check(samples, law, wrong, f"engine, random {kind} draft, blocks of {full}")


@pytest.fixture(scope="module")
def sp(target_path, dspark_draft_path):
    with Speculator(target_path, dspark_draft_path, n_threads=THREADS, n_ctx=1024) as s:
        yield s


def test_fixed_seed_is_deterministic_and_seeds_matter(sp):
    a = sp.generate(PROMPT, 12, chat=True, sampling=T1)
    b = sp.generate(PROMPT, 12, chat=True, sampling=T1)
    assert a.tokens == b.tokens and a.stats.seed == 5 and b.stats.as_dict()["seed"] == 5
    others = {tuple(sp.generate(PROMPT, 12, chat=True, sampling=T1.with_seed(s)).tokens) for s in (6, 7, 8)}
    assert len(others | {tuple(a.tokens)}) > 1
    s = a.stats
    assert s.drafted > 0 and s.ms_sample > 0
    # a random seed is resolved and reported, so the run can be replayed
    r = sp.generate(PROMPT, 8, chat=True, sampling=T1.with_seed(None))
    assert r.stats.seed is not None
    assert sp.generate(PROMPT, 8, chat=True, sampling=T1.with_seed(r.stats.seed)).tokens == r.tokens


def test_temperature_zero_is_the_greedy_path(sp):
    g = sp.generate(PROMPT, 16, chat=True)
    assert sp.generate(PROMPT, 16, chat=True, sampling=SamplingParams.greedy()).tokens == g.tokens
    assert sp.generate(PROMPT, 16, chat=True, sampling=SamplingParams(temperature=0.0, seed=3)).tokens == g.tokens
    assert "seed" not in g.stats.as_dict()


def test_sampling_must_be_sampling_params(sp):
    with pytest.raises(TypeError, match="SamplingParams"):
        sp.generate(PROMPT, 4, sampling={"temperature": 1.0})


def test_reuse_prefix_keeps_results(sp):
    g = sp.generate(PROMPT, 16, chat=True)
    # same prompt again: no target decode at all for the prompt, same greedy output
    sp.generate(PROMPT, 16, chat=True, reuse_prefix=True)
    n = sp.target.n_decodes
    again = sp.generate(PROMPT, 16, chat=True, reuse_prefix=True)
    assert again.tokens == g.tokens
    assert sp.target.n_decodes - n == again.stats.cycles   # only verify decodes, no prefill
    # at T > 0 the reused row gives the same draws as a fresh prefill
    assert sp.generate(PROMPT, 12, chat=True, sampling=T1, reuse_prefix=True).tokens == \
        sp.generate(PROMPT, 12, chat=True, sampling=T1).tokens
    # a different prompt sharing the chat prefix: only the tail is decoded, output unchanged
    other = "Write one sentence about the sun."
    fresh = sp.generate(other, 16, chat=True)
    sp.generate(PROMPT, 4, chat=True, reuse_prefix=True)
    assert sp.generate(other, 16, chat=True, reuse_prefix=True).tokens == fresh.tokens


def test_reuse_after_an_abandoned_stream(sp):
    fresh = sp.generate(PROMPT, 12, chat=True, sampling=T1)
    it = sp.stream(PROMPT, 40, chat=True, sampling=T1.with_seed(99), reuse_prefix=True)
    next(it)
    next(it)
    it.close()   # abandoned mid-generation: the memories hold prompt + some emitted tokens
    assert sp.generate(PROMPT, 12, chat=True, sampling=T1, reuse_prefix=True).tokens == fresh.tokens


def _cli(*args):
    r = CliRunner().invoke(main, ["run", "-t", "1", "-c", "512", "-n", "10", "--json", *args], catch_exceptions=False)
    return r


def test_cli_sampling_flags(target_path, dspark_draft_path, llama_refs):
    """`run` at T > 0 with a draft: the flags reach the sampler chain (checked against the target
    through Llama), a seed replays the run, the greedy path reports no seed."""
    from llama_cpp import llama_cpp as ll

    base = ["-m", target_path, "-md", dspark_draft_path, "-p", CLI_PROMPT, "--raw", "-n", "16"]
    prompt = llama_refs.llm.tokenize(CLI_PROMPT.encode(), add_bos=True, special=True)
    ref = llama_refs.greedy(prompt, 16)
    g = _cli(*base, "--temp", "0")
    assert g.exit_code == 0, g.output
    greedy = json.loads(g.stdout)
    assert "seed" not in greedy["stats"] and greedy["tokens"] == ref
    # top-k 1 at temperature 1: the law is a point mass on the target's argmax
    one = json.loads(_cli(*base, "--temp", "1.0", "--top-k", "1", "--top-p", "1", "--min-p", "0", "--seed", "9").stdout)
    assert one["tokens"] == ref and one["stats"]["drafted"] > 0
    hot = ["--temp", "1.5", "--top-k", "3", "--top-p", "1", "--min-p", "0", "--seed", "3"]
    a = json.loads(_cli(*base, *hot).stdout)
    b = json.loads(_cli(*base, *hot).stdout)
    assert a["tokens"] == b["tokens"] and a["stats"]["seed"] == 3 and a["stats"]["drafted"] > 0
    # every sampled token is one of the target's 3 best after its own prefix (teacher-forced)
    llm = llama_refs.llm
    seq = list(prompt) + list(a["tokens"])
    ranks = []
    for i in range(len(a["tokens"])):
        llm.reset()
        llm.eval(seq[:len(prompt) + i])
        row = np.ctypeslib.as_array(ll.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        ranks.append(int((row > row[seq[len(prompt) + i]]).sum()))
    assert max(ranks) < 3, f"a token outside the top-3 of the target: ranks {ranks}"
    assert a["tokens"] != ref, "a hot top-3 run that never left the greedy path tells nothing"
    bad = CliRunner().invoke(main, ["run", "-m", target_path, "-p", "x", "--min-p", "-1"])
    assert bad.exit_code == 2 and "min_p" in bad.output


def test_ignore_eos_bans_end_of_generation_at_t_gt_0(sp):
    # a prompt whose answer ends quickly: with ignore_eos no EOG token is ever drawn (llama.cpp
    # turns --ignore-eos into a -inf logit bias on them), and the generation runs to max_tokens
    hot = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1)
    d = sp.generate("What is 2+2? Answer with just the number.", 24, chat=True, sampling=hot, ignore_eos=True)
    assert d.finish_reason == "length" and len(d.tokens) == 24
    assert not any(sp.target.is_eog(t) for t in d.tokens)
