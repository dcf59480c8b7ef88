"""Repeat / presence / frequency penalties at temperature 0.

llama.cpp applies the penalties before its greedy pick (common/sampling.cpp: penalties -> ... ->
temperature 0 -> dist); every front end must do the same, losslessly: each draft is verified
against the argmax of the penalized row, the penalty history including the drafted prefix.

References, none of them our own code:
* ``llama_cpp.Llama.generate`` / ``create_completion`` with ``repeat_penalty`` at temp 0: its
  penalties see the generated tokens only (the ``DSpark`` class's semantics, ``penalize_prompt``
  False);
* llama.cpp's own sampler chain (``llama_sampler_ref.LlamaChain``, penalties with the prompt in the
  history) over ``Llama``'s logits, token by token: llama-server's semantics (``run``, ``serve``);
* llama-server itself (slow test).
Every case first checks that the penalties change the target's greedy output, so dropping them
fails the comparison.
"""

from __future__ import annotations

import json

import llama_cpp
import numpy as np
import pytest

from greedy_ref import greedy, open_llama, TEST_THREADS
from llama_sampler_ref import LlamaChain
from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.decode.loop import Decoder
from pyllama_dspark.decode.engine import SpecDecoder
from pyllama_dspark.llama.draft_meta import read_draft_meta
from pyllama_dspark.llama.handles import ContextSettings, Draft, Target
from pyllama_dspark.speculative.oracle import OracleProposer
from pyllama_dspark.speculative.sampling_params import SamplingParams

PENALTY = 1.3
N = 16
THREADS = TEST_THREADS
TEXTS = ["List ten fruits: apple, banana,",
         "The cat sat on the mat. The cat sat on the mat. The cat"]


def _eog(llm, tok) -> bool:
    return bool(llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok))


def ref_llama(llm, prompt, n, penalty=PENALTY):
    """llama-cpp-python's own greedy sampler with a repeat penalty (generated tokens only)."""
    llm.reset()
    out = []
    for tok in llm.generate(list(prompt), temp=0.0, repeat_penalty=penalty, reset=True):
        out.append(int(tok))
        if _eog(llm, tok) or len(out) >= n:
            break
    return out


def ref_chain(llm, prompt, n, penalty=PENALTY):
    """llama.cpp's sampler chain at temperature 0 with the prompt in the penalty history (as
    llama-server feeds its sampler), over Llama's logits decoded token by token."""
    llm.reset()
    llm.eval(list(prompt))
    chain = LlamaChain(SamplingParams(temperature=0.0, repeat_penalty=penalty), llm.n_vocab(), prompt)
    out = []
    try:
        while True:
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()
            p = chain.probs(row)
            assert np.count_nonzero(p) == 1  # temperature 0: one survivor
            tok = int(np.argmax(p))
            chain.accept(tok)
            out.append(tok)
            if _eog(llm, tok) or len(out) >= n:
                break
            llm.eval([tok])
    finally:
        chain.close()
    return out


@pytest.fixture(scope="module")
def cases(target_path):
    """(prompt tokens, plain greedy, llama.cpp chain reference, Llama reference) per text."""
    llm = open_llama(target_path)
    out = []
    for text in TEXTS:
        p = llm.tokenize(text.encode(), add_bos=True, special=True)
        out.append((p, greedy(llm, p, N), ref_chain(llm, p, N), ref_llama(llm, p, N)))
    llm.close()
    for p, plain, chain, ll in out:
        # the penalties must matter here, or the comparisons below could not fail for dropping them
        assert chain != plain and ll != plain
    return out


def _pen(penalize_prompt=True):
    return SamplingParams(temperature=0.0, repeat_penalty=PENALTY, penalize_prompt=penalize_prompt)


@pytest.mark.parametrize("penalize_prompt", [True, False])
def test_engine_with_a_draft(target_path, dspark_draft_path, cases, penalize_prompt):
    with Speculator(target_path, dspark_draft_path, n_threads=THREADS, n_max=7) as sp:
        for p, _, chain, ll in cases:
            done = sp.generate(p, N, sampling=_pen(penalize_prompt))
            assert done.tokens == (chain if penalize_prompt else ll)
            assert done.stats.drafted > 0


def test_engine_oracle_partial_acceptance(target_path, cases):
    """The oracle proposes the penalized reference with planted errors: long accepted blocks,
    rejections at every position and bonus tokens, all against the penalized argmax.  The errors
    are planted at set positions (a random draw over the few blocks of 16 tokens can miss them all:
    it did on an AVX2-only machine, whose greedy references end otherwise)."""
    drafted = accepted = 0
    with Target(target_path, ContextSettings(n_threads=THREADS)) as t:
        for p, plain, chain, _ in cases:
            orc = OracleProposer(list(p) + list(chain), t.n_vocab, error_at=[2, None, 0, 4, 1, 3], seed=1)
            done = SpecDecoder(t, orc).generate(p, N, n_max=7, sampling=_pen())
            assert done.tokens == chain
            drafted += done.stats.drafted
            accepted += done.stats.accepted
            # the unpenalized continuation as drafts: accepted where it agrees, never past that
            orc = OracleProposer(list(p) + list(plain), t.n_vocab, p_error=0.0)
            assert SpecDecoder(t, orc).generate(p, N, n_max=7, sampling=_pen()).tokens == chain
    assert 0 < accepted < drafted


def test_batched_decoder(target_path, dspark_draft_path, cases):
    """Penalized greedy, plain greedy and penalized greedy again side by side in one batch."""
    meta = read_draft_meta(dspark_draft_path)
    s = ContextSettings(n_ctx=1024 * 3, n_threads=THREADS, n_seq_max=3)
    with Target(target_path, s, capture_layers=meta.target_layers) as t:
        d = Draft(dspark_draft_path, t, s)
        (p0, _, chain0, _), (p1, plain1, chain1, _) = cases
        bd = Decoder(t, d, n_max=7)
        done = bd.run([p0, p1, p1], N, sampling=[_pen(), None, _pen()])
        assert [dn.tokens for dn in done] == [chain0, plain1, chain1]
        assert max(bd.verify_batches) > 8


def test_dspark_class_matches_llama(target_path, dspark_draft_path, cases):
    from llama_cpp import Llama

    from pyllama_dspark import DSpark

    llm = Llama(model_path=target_path, n_ctx=4096, n_batch=512, flash_attn=True, verbose=False)
    refs = [llm.create_completion(text, max_tokens=N, temperature=0, repeat_penalty=PENALTY)["choices"][0]["text"]
            for text in TEXTS]
    plain = [llm.create_completion(text, max_tokens=N, temperature=0)["choices"][0]["text"] for text in TEXTS]
    llm.close()
    assert refs != plain
    with DSpark(target_path, dspark_draft_path, n_max=7) as ds:
        ours = [ds.create_completion(text, max_tokens=N, temperature=0, repeat_penalty=PENALTY)["choices"][0]["text"]
                for text in TEXTS]
        with pytest.raises(ValueError):
            ds.create_completion(TEXTS[0], max_tokens=4, temperature=0, repeat_penalty=0.0)
    assert ours == refs


def test_run_cli(target_path, dspark_draft_path, cases):
    from click.testing import CliRunner

    from pyllama_dspark.cli.main import main

    p, _, chain, _ = cases[0]
    res = CliRunner().invoke(main, ["run", "-m", target_path, "-md", dspark_draft_path, "--raw", "-p", TEXTS[0],
                                    "-n", str(N), "--temp", "0", "--repeat-penalty", str(PENALTY), "--json",
                                    "-t", str(THREADS)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["tokens"] == chain


def test_server_keeps_penalties_at_temperature_0():
    from pyllama_dspark.serve.oai_request import GenRequest, RequestError
    from pyllama_dspark.serve.server import LLAMA_SERVER_SAMPLING, sampling_for

    s = sampling_for(GenRequest(kind="completion", sampling={"temperature": 0, "repeat_penalty": 1.3}),
                     LLAMA_SERVER_SAMPLING)
    assert s is not None and s.is_greedy and s.repeat_penalty == pytest.approx(1.3) and s.penalize_prompt
    assert sampling_for(GenRequest(kind="completion", sampling={"temperature": 0}), LLAMA_SERVER_SAMPLING) is None
    s = sampling_for(GenRequest(kind="completion", sampling={"temperature": 0, "presence_penalty": 0.5}),
                     LLAMA_SERVER_SAMPLING)
    assert s is not None and s.presence_penalty == 0.5
    with pytest.raises(RequestError):
        sampling_for(GenRequest(kind="completion", sampling={"temperature": 0, "repeat_penalty": 0.0}),
                     LLAMA_SERVER_SAMPLING)


@pytest.mark.slow
def test_llama_server_same_tokens(target_path, dspark_draft_path, cases):
    from pyllama_dspark.upstream.llama_server import LlamaServer
    from pyllama_dspark.upstream.llama_server_build import ensure_llama_server

    binary = ensure_llama_server()
    with LlamaServer(binary, target_path, dspark_draft_path, spec_type="draft-dspark", n_max=7, ctx=4096,
                     threads=THREADS, n_batch=512, n_ubatch=512, flash_attn="auto") as srv, \
            Speculator(target_path, dspark_draft_path, n_ctx=4096, n_batch=512, n_threads=THREADS,
                       flash_attn="auto", n_max=7) as sp:
        for p, plain, chain, _ in cases:
            cpp = srv.complete(p, N, repeat_penalty=PENALTY, repeat_last_n=64)["tokens"]
            cpp_plain = srv.complete(p, N)["tokens"]
            ours = sp.generate(p, N, sampling=SamplingParams(temperature=0.0, repeat_penalty=PENALTY)).tokens
            assert cpp_plain == plain and cpp != cpp_plain   # the penalty reaches llama-server
            assert ours == cpp == chain
