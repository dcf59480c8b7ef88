"""Bad input never aborts the process: each case is a clear Python exception, and the interpreter
that raised all of them is still alive afterwards (proved in one subprocess running every case).

Besides broken files and mismatched pairs: n_max <= 0 (constructor and per call, Speculator and
DSpark), an empty prompt, token ids outside the vocabulary (negative, too large, not integers),
max_tokens <= 0 (Speculator; the DSpark class follows llama-cpp-python, where max_tokens <= 0 means
"until the context is full", checked against ``Llama`` itself), an empty stop string, and a tiny
n_ctx (llama.cpp rounds it up to 256: a prompt that does not fit is refused, a generation that fills
the context stops there with the target's greedy tokens).  The CLI turns the same input into a
one-line error, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

# 251 tokens of it leave 5 for generation in a 256-token context; the target's greedy choices there
# are far from near-ties (top-2 logit gaps >= 3)
LONG_TEXT = "Alice counted her apples: one, two, three, four, five, six, seven, eight, nine, ten. " * 20

SCRIPT = textwrap.dedent(r"""
    import json, os, sys
    from pyllama_dspark import Speculator
    from pyllama_dspark.speculative.sampling_params import SamplingParams
    from pyllama_dspark.gguf.testing import make_test_draft
    target, draft, work, LONG_TEXT = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]

    def small(name, **kw):
        path = os.path.join(work, name + ".gguf")
        make_test_draft(target, path, kind="dspark", n_layers=1, markov_rank=8, **kw)
        return path

    def stub_target(name, arch):
        import gguf
        path = os.path.join(work, name + ".gguf")
        w = gguf.GGUFWriter(path, arch)
        w.add_uint32(arch + ".embedding_length", 576)
        w.add_uint32(arch + ".block_count", 30)
        w.add_string("tokenizer.ggml.model", "gpt2")
        w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
        w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
        return path

    not_gguf = os.path.join(work, "not.gguf")
    open(not_gguf, "wb").write(b"this is not a gguf file at all" * 10)
    truncated = os.path.join(work, "truncated.gguf")
    data = open(draft, "rb").read()
    open(truncated, "wb").write(data[: len(data) * 2 // 3])

    def run_long_prompt():
        with Speculator(target, draft, n_ctx=64, n_threads=1) as sp:
            sp.generate("word " * 2000, 4)

    def run_n_max_generate():
        with Speculator(target, draft, n_threads=1) as sp:
            sp.generate("hi", 4, n_max=0)

    def run_n_max_negative_generate():
        with Speculator(target, draft, n_threads=1) as sp:
            sp.generate("hi", 4, n_max=-2)

    sp = Speculator(target, draft, n_ctx=512, n_threads=1)     # one model load for the generate cases
    from pyllama_dspark.integrations.dspark import DSpark
    ds = DSpark(target, draft, n_ctx=512, n_threads=1)

    def tiny_ctx(prompt, n, kind="dspark", **kw):
        d = draft if kind == "dspark" else make_dflash()
        with Speculator(target, d, n_ctx=8, n_threads=1) as tiny:
            done = tiny.generate(prompt, n, **kw)
            return {"n_ctx": tiny.target.n_ctx, "prompt": list(prompt), "tokens": done.tokens,
                    "finish_reason": done.finish_reason}

    long_prompt = sp.tokenize(LONG_TEXT, add_special=False)[:251]

    def tiny_ctx_batched(n_seq):
        from pyllama_dspark.decode.loop import Decoder
        from pyllama_dspark.llama.handles import ContextSettings
        from pyllama_dspark.llama.models import open_models
        t, d, _ = open_models(target, draft, ContextSettings(n_ctx=8 if n_seq == 1 else 256 * n_seq, n_threads=1,
                                                             n_seq_max=n_seq))
        with t:
            bd = Decoder(t, d, n_max=7)
            done = bd.run([long_prompt] * n_seq, 50)
            return {"n_ctx": t.n_ctx // n_seq, "prompt": list(long_prompt), "tokens": [x.tokens for x in done],
                    "finish_reason": [x.finish_reason for x in done]}

    def make_dflash():
        path = os.path.join(work, "dflash.gguf")
        if not os.path.exists(path):
            make_test_draft(target, path, kind="dflash", n_layers=1)
        return path

    cases = {
        "missing_target": lambda: Speculator(os.path.join(work, "nope.gguf")),
        "missing_draft": lambda: Speculator(target, os.path.join(work, "nope.gguf")),
        "not_gguf": lambda: Speculator(target, not_gguf),
        "truncated": lambda: Speculator(target, truncated),
        "n_embd_mismatch": lambda: Speculator(target, small("embd", overrides={"@n_embd": 512})),
        "vocab_mismatch": lambda: Speculator(target, small("vocab", overrides={"@n_vocab": 49000})),
        "layer_id_n_layer": lambda: Speculator(target, small("lid30", target_layers=[2, 9, 30])),
        "layer_id_beyond": lambda: Speculator(target, small("lid31", target_layers=[2, 9, 31])),
        "no_block_size": lambda: Speculator(target, small("nobs", overrides={"dflash.block_size": None})),
        "f16_fc": lambda: Speculator(target, small("f16", fc_type="f16")),
        "unsupported_arch": lambda: Speculator(stub_target("phi3", "phi3"), draft),
        "prompt_longer_than_context": run_long_prompt,
        "n_max_zero": lambda: Speculator(target, draft, n_max=0),
        "n_max_negative": lambda: Speculator(target, draft, n_max=-3),
        "n_max_zero_generate": run_n_max_generate,
        "n_max_negative_generate": run_n_max_negative_generate,
        "empty_prompt_text": lambda: sp.generate("", 4),
        "empty_prompt_ids": lambda: sp.generate([], 4),
        "negative_token_id": lambda: sp.generate([1, -5, 3], 4),
        "token_id_past_vocab": lambda: sp.generate([1, 49152], 4),
        "token_id_huge": lambda: sp.generate([1, 2 ** 40], 4),
        "token_id_not_int": lambda: sp.generate([1, 2.5], 4),
        "max_tokens_zero": lambda: sp.generate("hi", 0),
        "max_tokens_negative": lambda: sp.generate([1, 2, 3], -1),
        "stop_empty_string": lambda: sp.generate("hi", 4, chat=True, stop=[""]),
        "tiny_ctx_prompt_too_long": lambda: tiny_ctx(list(range(1000, 1300)), 4),
        "dspark_n_max_negative": lambda: DSpark(target, draft, n_max=-1),
        "dspark_empty_prompt": lambda: ds.create_completion("", max_tokens=4, temperature=0),
        "dspark_negative_token_id": lambda: ds.create_completion([1, -3], max_tokens=4, temperature=0),
        "dspark_stop_empty_string": lambda: ds.create_completion("Hello", max_tokens=4, temperature=0, stop=[""]),
        "dspark_chat_stop_empty_string": lambda: ds.create_chat_completion(
            [{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, stop=""),
        # not errors: results the parent process checks against llama_cpp.Llama
        "ok_tiny_ctx_fills_context": lambda: tiny_ctx(long_prompt, 50),
        "ok_tiny_ctx_fills_context_dflash": lambda: tiny_ctx(long_prompt, 50, kind="dflash"),
        "ok_tiny_ctx_fills_context_sampled": lambda: tiny_ctx(
            long_prompt, 50, sampling=SamplingParams(temperature=1.0, seed=3)),
        "ok_tiny_ctx_fills_context_batched": lambda: tiny_ctx_batched(1),
        "ok_tiny_ctx_fills_context_batched_2": lambda: tiny_ctx_batched(2),
    }
    out = {}
    for name, fn in cases.items():
        try:
            res = fn()
            out[name] = ["no exception", res if name.startswith("ok_") else ""]
        except BaseException as e:  # noqa: BLE001 - we report whatever came out
            out[name] = [type(e).__name__, str(e)]
    sp.close()
    ds.close()
    print(json.dumps(out))
    print("ALIVE")
""")

EXPECTED = {
    "missing_target": ("ModelFileError", "not found"),
    "missing_draft": ("ModelFileError", "not found"),
    "not_gguf": ("ModelFileError", "GGUF"),
    "truncated": ("ModelFileError", "truncated"),
    "n_embd_mismatch": ("DraftMismatchError", "n_embd"),
    "vocab_mismatch": ("DraftMismatchError", "vocab"),
    "layer_id_n_layer": ("DraftMismatchError", "30"),
    "layer_id_beyond": ("DraftMismatchError", "31"),
    "no_block_size": ("DraftMismatchError", "block_size"),
    "f16_fc": ("DraftMismatchError", "F16"),
    "unsupported_arch": ("UnsupportedArchError", "phi3"),
    "prompt_longer_than_context": ("ContextOverflowError", "context"),
    "n_max_zero": ("ValueError", "n_max"),
    "n_max_negative": ("ValueError", "n_max"),
    "n_max_zero_generate": ("ValueError", "n_max"),
    "n_max_negative_generate": ("ValueError", "n_max"),
    "empty_prompt_text": ("ValueError", "empty"),
    "empty_prompt_ids": ("ValueError", "empty"),
    "negative_token_id": ("ValueError", "token ids"),
    "token_id_past_vocab": ("ValueError", "0..49151"),
    "token_id_huge": ("ValueError", "token ids"),
    "token_id_not_int": ("TypeError", "integers"),
    "max_tokens_zero": ("ValueError", "max_tokens"),
    "max_tokens_negative": ("ValueError", "max_tokens"),
    "stop_empty_string": ("ValueError", "stop"),
    "tiny_ctx_prompt_too_long": ("ContextOverflowError", "context of 256"),
    "dspark_n_max_negative": ("ValueError", "n_max"),
    "dspark_empty_prompt": ("ValueError", "empty"),
    "dspark_negative_token_id": ("ValueError", "token ids"),
    "dspark_stop_empty_string": ("ValueError", "stop"),
    "dspark_chat_stop_empty_string": ("ValueError", "stop"),
}


@pytest.fixture(scope="module")
def outcome(target_path, dspark_draft_path, tmp_path_factory):
    work = tmp_path_factory.mktemp("bad")
    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    p = subprocess.run([sys.executable, "-c", SCRIPT, target_path, dspark_draft_path, str(work), LONG_TEXT],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, f"interpreter died (rc {p.returncode}):\n{p.stderr[-3000:]}"
    lines = p.stdout.strip().splitlines()
    assert lines[-1] == "ALIVE"
    return json.loads(lines[-2])


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_input_is_a_clear_exception(outcome, case):
    kind, fragment = EXPECTED[case]
    got_kind, msg = outcome[case]
    assert got_kind == kind, f"{case}: {got_kind}: {msg}"
    assert fragment.lower() in msg.lower(), f"{case}: message does not say what is wrong: {msg}"


@pytest.mark.parametrize("case", ["ok_tiny_ctx_fills_context", "ok_tiny_ctx_fills_context_dflash",
                                  "ok_tiny_ctx_fills_context_sampled", "ok_tiny_ctx_fills_context_batched",
                                  "ok_tiny_ctx_fills_context_batched_2"])
def test_a_tiny_context_fills_up_and_stops(outcome, case, llama_refs):
    """n_ctx=8 is rounded up by llama.cpp; a 251-token prompt leaves room for 5 tokens: the draft
    block near the end must shrink to what the context holds (it used to overflow the draft's KV
    cache: NativeError), and greedy output is the target's own.  Also through the batched decoder
    (one sequence in a tiny context; two sequences of 256 positions each)."""
    got_kind, res = outcome[case]
    assert got_kind == "no exception", f"{case}: {got_kind}: {res}"
    prompt = res["prompt"]
    assert prompt == llama_refs.llm.tokenize(LONG_TEXT.encode(), add_bos=False)[:251]
    outs = res["tokens"] if "batched" in case else [res["tokens"]]
    reasons = res["finish_reason"] if "batched" in case else [res["finish_reason"]]
    assert res["n_ctx"] == 256 and set(reasons) == {"length"}
    for toks in outs:
        assert len(toks) == res["n_ctx"] - len(prompt) == 5
        if "sampled" not in case:
            assert toks == llama_refs.greedy(prompt, 5)


def test_dspark_max_tokens_zero_means_until_the_context_is_full_as_in_llama(target_path, dspark_draft_path):
    """llama-cpp-python reads max_tokens <= 0 (or None) as "until the context is full"; the DSpark
    class keeps that meaning (it is not bad input there): same text, usage and finish reason as a
    plain Llama with the same context."""
    from llama_cpp import Llama

    from pyllama_dspark.integrations.dspark import DSpark

    llm = Llama(model_path=target_path, n_ctx=256, n_threads=1, n_threads_batch=1, flash_attn=True, verbose=False)
    try:
        prompt = llm.tokenize(LONG_TEXT.encode(), add_bos=False)[:251]   # 5 more tokens fit
        refs = {}
        for n in (0, -1):
            llm.reset()
            refs[n] = llm.create_completion(prompt, max_tokens=n, temperature=0)
    finally:
        llm.close()
    with DSpark(target_path, dspark_draft_path, n_ctx=256, n_threads=1, flash_attn="on") as ds:
        for n, ref in refs.items():
            r = ds.create_completion(prompt, max_tokens=n, temperature=0)
            assert ref["usage"] == {"prompt_tokens": 251, "completion_tokens": 5, "total_tokens": 256}
            assert r["usage"] == ref["usage"], n
            assert r["choices"][0]["text"] == ref["choices"][0]["text"], n
            assert r["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"] == "length"


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "pyllama_dspark.cli.main", *args], capture_output=True, text=True,
                          timeout=300, **kw)


def test_cli_bad_input_is_a_one_line_error(target_path, dspark_draft_path):
    base = ["run", "-m", target_path, "-md", dspark_draft_path, "-t", "1", "--temp", "0"]
    for extra, code, needle in [
        (["--n-max", "-1", "-p", "hi"], 2, "--n-max"),
        (["--n-max", "0", "-p", "hi"], 2, "--n-max"),
        (["-n", "0", "-p", "hi"], 2, "-n"),
        (["-n", "-5", "-p", "hi"], 2, "-n"),
        (["--raw", "-p", ""], 1, "empty"),
        (["-c", "8", "-p", "word " * 300], 1, "context"),
    ]:
        p = _cli(*base, *extra)
        assert p.returncode == code, (extra, p.returncode, p.stderr[-2000:])
        assert "Error:" in p.stderr and needle in p.stderr and "Traceback" not in p.stderr, (extra, p.stderr[-2000:])
    # a tiny context is fine as long as the prompt fits: generation stops when the context is full
    p = _cli(*base, "-c", "8", "--raw", "-p", "one two three four " * 60, "-n", "200", "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["finish_reason"] == "length" and out["stats"]["n_prompt"] + len(out["tokens"]) == 256


def test_cli_reports_errors_without_a_traceback(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pyllama_dspark.cli.main", "run", "-m", str(tmp_path / "missing.gguf"),
                        "-p", "hi"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert "Error:" in p.stderr and "not found" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "pyllama_dspark.cli.main", "run", "-p", "hi", "--top-p", "1.5"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "top_p" in p.stderr and "Traceback" not in p.stderr
