"""T > 0 through the engine, the Python API and the CLI: determinism, the greedy path, prefix reuse."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pyllama_dspark.api import Speculator
from pyllama_dspark.cli import main
from pyllama_dspark.sampling import SamplingParams

THREADS = 1
T1 = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05, seed=5)
PROMPT = "Write one sentence about the moon."


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


def test_dflash_draft_samples_too(target_path, dflash_draft_path):
    with Speculator(target_path, dflash_draft_path, n_threads=THREADS, n_ctx=1024) as s:
        a = s.generate(PROMPT, 10, chat=True, sampling=T1)
        assert a.tokens == s.generate(PROMPT, 10, chat=True, sampling=T1).tokens
        assert a.stats.drafted > 0


def _cli(*args):
    r = CliRunner().invoke(main, ["run", "-t", "1", "-c", "512", "-n", "10", "--json", *args], catch_exceptions=False)
    return r


def test_cli_sampling_flags(target_path):
    base = ["-m", target_path, "-p", PROMPT, "--no-draft"]
    g = _cli(*base, "--temp", "0")
    assert g.exit_code == 0, g.output
    greedy = json.loads(g.stdout)
    a = json.loads(_cli(*base, "--temp", "1.0", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.01", "--seed", "3").stdout)
    b = json.loads(_cli(*base, "--temp", "1.0", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.01", "--seed", "3").stdout)
    assert a["tokens"] == b["tokens"] and a["stats"]["seed"] == 3
    assert "seed" not in greedy["stats"]
    bad = CliRunner().invoke(main, ["run", "-m", target_path, "-p", "x", "--min-p", "-1"])
    assert bad.exit_code == 2 and "min_p" in bad.output


def test_ignore_eos_bans_end_of_generation_at_t_gt_0(sp):
    # a prompt whose answer ends quickly: with ignore_eos no EOG token is ever drawn (llama.cpp
    # turns --ignore-eos into a -inf logit bias on them), and the generation runs to max_tokens
    hot = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1)
    d = sp.generate("What is 2+2? Answer with just the number.", 24, chat=True, sampling=hot, ignore_eos=True)
    assert d.finish_reason == "length" and len(d.tokens) == 24
    assert not any(sp.target.is_eog(t) for t in d.tokens)
