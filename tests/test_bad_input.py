"""Bad input never aborts the process: each case is a clear Python exception, and the interpreter
that raised all of them is still alive afterwards (proved in one subprocess running every case)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(r"""
    import json, os, sys
    from pyllama_dspark import Speculator
    from pyllama_dspark.testing import make_test_draft
    target, draft, work = sys.argv[1], sys.argv[2], sys.argv[3]

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
        "n_max_negative_generate": run_n_max_generate,
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = ["no exception", ""]
        except BaseException as e:  # noqa: BLE001 - we report whatever came out
            out[name] = [type(e).__name__, str(e)]
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
    "n_max_negative_generate": ("ValueError", "n_max"),
}


@pytest.fixture(scope="module")
def outcome(target_path, dspark_draft_path, tmp_path_factory):
    work = tmp_path_factory.mktemp("bad")
    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    p = subprocess.run([sys.executable, "-c", SCRIPT, target_path, dspark_draft_path, str(work)],
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


def test_cli_reports_errors_without_a_traceback(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pyllama_dspark.cli", "run", "-m", str(tmp_path / "missing.gguf"),
                        "-p", "hi"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert "Error:" in p.stderr and "not found" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "pyllama_dspark.cli", "run", "-p", "hi", "--top-p", "1.5"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "top_p" in p.stderr and "Traceback" not in p.stderr
