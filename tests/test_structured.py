"""Structured output, logit bias and token probabilities under speculation, against independent
references: llama-cpp-python's ``Llama`` with the same grammar / schema / bias (greedy), llama.cpp's
sampler chain with its grammar sampler (the law of the first constrained tokens), ``jsonschema``,
and llama.cpp's own llama-server (the same grammar and draft; its ``n_probs``).

Drafting is forced (``schedule="off"``: every step verifies a full block) with the shipped drafter,
so accepted drafts, grammar cuts and rejections all happen.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from llama_cpp import LlamaGrammar

from first_tokens_law import first_two, law_check, two_token_law
from greedy_ref import TEST_THREADS
from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.paths import default_draft
from pyllama_dspark.llama.grammar import schema_to_gbnf
from pyllama_dspark.speculative.sampling_params import SamplingParams

N = 40
PROMPTS = ["Is the sea salty? Answer and explain.", "List three animals that live in the ocean."]
GBNF = r'''root ::= ("Yes" | "No") ", " [a-z ,]+ "."'''
LIST_GBNF = r'''root ::= item item item
item ::= "- " [A-Za-z ]+ "\n"'''
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "legs": {"type": "integer"}, "can_fly": {"type": "boolean"}},
          "required": ["name", "legs", "can_fly"]}
SCHEMA_PROMPT = "Describe a bird as JSON with its name, number of legs and whether it can fly."


@pytest.fixture(scope="module")
def sp(target_path):
    with Speculator(target_path, default_draft(), n_ctx=2048, n_threads=TEST_THREADS, schedule="off") as s:
        yield s


def _prompt(sp, text):
    return list(sp.chat_prompt([{"role": "user", "content": text}]).tokens)


def _llama_greedy(refs, prompt, n, **kw):
    llm = refs.llm
    llm.reset()
    r = llm.create_completion(prompt, max_tokens=n, temperature=0.0, **kw)
    return r["choices"][0]["text"]


@pytest.mark.parametrize("gbnf", [GBNF, LIST_GBNF], ids=["yes-no", "list"])
def test_grammar_greedy_equals_llama_with_the_same_grammar(sp, llama_refs, gbnf):
    drafted = cut = 0
    for text in PROMPTS:
        prompt = _prompt(sp, text)
        done = sp.generate(prompt, N, grammar=gbnf)
        ref = _llama_greedy(llama_refs, prompt, N, grammar=LlamaGrammar.from_string(gbnf, verbose=False))
        assert done.text == ref, (text, done.text, ref)
        drafted += done.stats.drafted
        cut += sum(1 for d in done.stats.verify_lengths if d < 7)
    assert drafted > 0 and cut > 0, "drafting was forced, and some blocks must have been cut by the grammar"


def test_json_schema_output_validates_and_equals_llama(sp, llama_refs):
    import jsonschema

    gbnf = schema_to_gbnf(SCHEMA)
    prompt = _prompt(sp, SCHEMA_PROMPT)
    done = sp.generate(prompt, 96, grammar=gbnf)
    ref = _llama_greedy(llama_refs, prompt, 96, grammar=LlamaGrammar.from_json_schema(json.dumps(SCHEMA),
                                                                                          verbose=False))
    assert done.text == ref
    assert done.finish_reason == "stop", "the schema's object must close within the budget"
    jsonschema.validate(json.loads(done.text), SCHEMA)
    assert done.stats.drafted > 0


def test_logit_bias_greedy_equals_llama(sp, llama_refs):
    prompt = _prompt(sp, PROMPTS[1])
    plain = sp.generate(prompt, 12)
    # forbid the first two tokens the target picks and push another one up
    bias = {int(plain.tokens[0]): float("-inf"), int(plain.tokens[1]): -100.0, 330: 2.5}
    done = sp.generate(prompt, N, logit_bias=bias)
    ref = _llama_greedy(llama_refs, prompt, N, logit_bias={k: (-1e30 if v == float("-inf") else v)
                                                           for k, v in bias.items()})
    assert done.tokens[0] != plain.tokens[0]
    assert done.text == ref


def test_constrained_sampling_follows_the_constrained_law(sp, llama_refs):
    """T > 0 with a grammar: the first two tokens follow llama.cpp's chain with its grammar sampler
    (the no-draft constrained law); the unconstrained law is rejected by the same samples."""
    gbnf = r'''root ::= " " [a-z] [a-z ]*'''
    params = SamplingParams(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)
    llm = llama_refs.llm
    prompt = llm.tokenize(b"The capital of France is", add_bos=True, special=True)
    law = two_token_law(llm, prompt, params, grammar=gbnf)
    free = two_token_law(llm, prompt, params)
    samples = [first_two(sp, prompt, 9, sampling=params.with_seed(500 + i), grammar=gbnf) for i in range(240)]
    law_check(samples, law, free, "constrained sampling, shipped drafter, forced blocks")


@pytest.mark.slow
def test_grammar_and_n_probs_match_llama_server(target_path, sp):
    """The same GBNF through llama.cpp's own llama-server with the same draft: the same tokens.
    n_probs at T = 0 (ours drafting, llama-server without a draft): the same tokens, each
    probability within the batch-shape rounding, the same top-N sets except at measured near-ties."""
    from pyllama_dspark.upstream.llama_server import LlamaServer
    from pyllama_dspark.upstream.llama_server_build import ensure_llama_server

    binary = ensure_llama_server()
    prompts = [_prompt(sp, t) for t in PROMPTS]
    with LlamaServer(binary, target_path, default_draft(), n_max=7, ctx=2048, threads=TEST_THREADS) as srv:
        for prompt in prompts:
            cpp = srv.complete(prompt, N, grammar=GBNF)
            ours = sp.generate(prompt, N, grammar=GBNF)
            assert cpp["tokens"] == ours.tokens, (cpp["content"], ours.text)
    n_top, near, worst = 5, 0, 0.0
    with LlamaServer(binary, target_path, None, ctx=2048, threads=TEST_THREADS) as srv:
        for prompt in prompts:
            cpp = srv.complete(prompt, 24, n_probs=n_top)
            ours = sp.generate(prompt, 24, n_probs=n_top)
            assert cpp["tokens"] == ours.tokens
            rows = cpp["raw"]["completion_probabilities"]
            assert len(rows) == len(ours.probs)
            for row, tp in zip(rows, ours.probs):
                assert row["id"] == tp.id
                lp = np.log(tp.prob)
                worst = max(worst, abs(lp - row["logprob"]))
                cset = [t["id"] for t in row["top_logprobs"]]
                oset = [t for t, _ in tp.top]
                if set(cset) != set(oset):
                    # allowed only where the n-th and (n+1)-th are a near-tie in the reference
                    lps = sorted((t["logprob"] for t in row["top_logprobs"]), reverse=True)
                    ours_nth = sorted((np.log(p) for _, p in tp.top), reverse=True)
                    assert abs(lps[-1] - ours_nth[-1]) < 0.05, (row, tp)
                    near += 1
    print(f"\nn_probs vs llama-server: worst |logprob diff| {worst:.4f}, top-{n_top} near-ties {near}")
    assert worst < 0.05
