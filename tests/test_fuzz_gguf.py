"""Fuzzing GGUF loading (a fast, seeded subset; the long run is ``bench/fuzz_long.py``).

Small random target / drafts (a 2-layer llama target with a 512-token vocabulary, a DSpark and a
DFlash draft for it) are mutated -- headers (magic, version, tensor / kv counts), metadata (value
types, string lengths, array types and counts, values: 0, -1, huge, NaN, ...), tensor infos
(n_dims, dims, ggml type, offsets: misaligned, past the end, overlapping), an inserted
``general.alignment``, random bytes, truncation at every section boundary -- and loaded through
the public paths (``Speculator(target, draft)`` + one token, ``pyllama-dspark inspect``, ``run -n
1``), many cases per subprocess, each in a forked child (:mod:`fuzz_gguf`).  Every case must end
as a load or a clean error (a :class:`~pyllama_dspark.errors.DSparkError`; a CLI exit 1 / 2 with
one ``Error:`` line): never a signal, a traceback, a hang.

Found by it (each kept below as a regression): gguf-py parsing garbage for minutes or running out
of memory on a retyped key or a huge array count; llama.cpp aborting on ``block_count`` 0 or >
512, a NaN / negative norm epsilon, a DSpark ``block_size`` of 256+, an integer-typed weight, a
non-F32 1-D tensor, tensor data not 32-byte aligned (also without a draft: the checks run before every
llama.cpp load); a DFlash draft with ``block_size`` 1 failing only at the first generate.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_gguf import apply_ops, is_failure, layout_of, make_cases, mutation_strategy, run_cases

CI = dict(derandomize=True, deadline=None, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from pyllama_dspark.gguf.target_writer import make_test_target
    from pyllama_dspark.gguf.testing import make_test_draft

    d = tmp_path_factory.mktemp("fuzz-gguf")
    target = make_test_target(d / "target.gguf", "llama", n_vocab=512, n_layer=2, n_embd=64, n_head=2, n_head_kv=1,
                              head_dim=32, n_ff=128, vocab_type="f32")
    dspark = make_test_draft(target, d / "dspark.gguf", kind="dspark", n_layers=1, markov_rank=8)
    dflash = make_test_draft(target, d / "dflash.gguf", kind="dflash", n_layers=1)
    return {"target": str(target), "draft": dspark, "dflash": dflash}


def _cases(files, which, ops_list, modes=None):
    kind = "target" if which == "target" else "draft"
    modes = modes or (("speculator", "nodraft", "inspect", "run") if kind == "target" else ("speculator", "inspect", "run"))
    return make_cases(which, kind, files[which], files["target"], files["draft" if which == "target" else which],
                      ops_list, modes)


def _check(cases, results):
    bad = [(c["mode"], c["ops"], r["outcome"], r["detail"][-800:]) for c, r in zip(cases, results) if is_failure(r)]
    assert not bad, "\n\n".join(map(str, bad))


@pytest.mark.parametrize("which", ["target", "draft"])
def test_truncated_at_every_section_boundary(files, which):
    """Cut at the end of the header, of every key, type and value, of every tensor info, at the
    data start and in the middle of every tensor's data: each is a clean error."""
    lay = layout_of(files[which])
    ops = [[["truncate", b]] for b in lay.boundaries()]
    assert len(ops) > 100
    modes = ["speculator"] * 3 + ["inspect", "run"]
    cases = _cases(files, which, ops, modes)
    results = run_cases(cases)
    _check(cases, results)
    assert all(r["outcome"] == "error" for r in results)


@pytest.mark.parametrize("which", ["target", "draft", "dflash"])
def test_mutations(files, which):
    """Hypothesis draws 2 x 45 mutations per file from the catalog (every field of the layout with
    values that break it), random bytes, truncations and pairs of mutations; one subprocess per
    batch."""
    lay = layout_of(files[which])

    @settings(max_examples=2, **CI)
    @given(st.lists(mutation_strategy(lay), min_size=45, max_size=45))
    def batch(ops_list):
        cases = _cases(files, which, ops_list)
        _check(cases, run_cases(cases))

    batch()


def _kv(lay, key):
    return next(kv for kv in lay.kvs if kv["key"] == key)


def _tensor(lay, name):
    return next(t for t in lay.tensors if t["name"] == name)


def _regressions(files):
    """(name, which, ops, message fragment): what the fuzzing found, each once a crash or a hang."""
    t, d, f = layout_of(files["target"]), layout_of(files["draft"]), layout_of(files["dflash"])
    u32 = lambda at, v: [["u32", at, v]]   # noqa: E731
    insert_alignment = lambda lay, v: [["u64", 16, lay.n_kv + 1], ["insert", lay.kv_end, (   # noqa: E731
        (17).to_bytes(8, "little") + b"general.alignment" + (4).to_bytes(4, "little") + v.to_bytes(4, "little")).hex()]]
    return [
        ("string key retyped as array (gguf-py hang)", "target", u32(_kv(t, "general.architecture")["type_at"], 9),
         "elements"),
        ("array count 2**29 (gguf-py hang)", "draft", [["u64", _kv(d, "dflash.target_layers")["count_at"], 2 ** 29]],
         "values of 'dflash.target_layers'"),
        ("array count 2**32", "draft", [["u64", _kv(d, "dflash.target_layers")["count_at"], 2 ** 32]], "maximum"),
        ("array count 2**62 (gguf-py out of memory)", "target",
         [["u64", _kv(t, "tokenizer.ggml.token_type")["count_at"], 2 ** 62]], "elements"),
        ("block_count 0", "target", u32(_kv(t, "llama.block_count")["value_at"], 0), "block_count"),
        ("block_count 1000", "draft", u32(_kv(d, "dflash.block_count")["value_at"], 1000), "block_count"),
        ("block_count 2**32-1", "target", u32(_kv(t, "llama.block_count")["value_at"], 2 ** 32 - 1), "block_count"),
        ("rms eps NaN", "target", [["f32", _kv(t, "llama.attention.layer_norm_rms_epsilon")["value_at"], float("nan")]],
         "eps"),
        ("rms eps -1", "draft", [["f32", _kv(d, "dflash.attention.layer_norm_rms_epsilon")["value_at"], -1.0]], "eps"),
        ("DSpark block_size 1000", "draft", u32(_kv(d, "dflash.block_size")["value_at"], 1000), "block_size"),
        ("DFlash block_size 1: nothing to draft (a ValueError at the first generate)", "dflash",
         u32(_kv(f, "dflash.block_size")["value_at"], 1), "no position to draft"),
        ("I32 matmul weight", "target", u32(_tensor(t, "blk.0.attn_q.weight")["type_at"], 26), "I32"),
        ("I32 fc.weight", "draft", u32(_tensor(d, "fc.weight")["type_at"], 26), "I32"),
        ("I32 norm", "target", u32(_tensor(t, "output_norm.weight")["type_at"], 26), "I32"),
        ("I16 last weight", "target", u32(_tensor(t, t.tensors[-1]["name"])["type_at"], 25), "I16"),
        ("F16 1-D norm (last tensor)", "draft", u32(d.tensors[-1]["type_at"], 1) if len(d.tensors[-1]["dims"]) == 1
         else u32(_tensor(d, "output_norm.weight")["type_at"], 1), "1-D"),
        ("alignment 1: tensor data not 32-byte aligned", "target", insert_alignment(t, 1), "aligned"),
        ("alignment 1 (draft)", "draft", insert_alignment(d, 1), "aligned"),
    ]


def test_found_by_fuzzing_is_a_clean_error(files):
    """Each regression through Speculator(target, draft), ``run`` and, for targets, the target alone."""
    cases, names = [], []
    for name, which, ops, fragment in _regressions(files):
        for mode in ("speculator", "run") + (("nodraft",) if which == "target" else ()):
            cases += _cases(files, which, [ops], (mode,))
            names.append((name, fragment))
    for i, c in enumerate(cases):
        c["id"] = f"reg-{i}"
    results = run_cases(cases)
    _check(cases, results)
    for (name, fragment), c, r in zip(names, cases, results):
        assert r["outcome"] == "error" and fragment in r["detail"], (name, c["mode"], r)


def test_real_cli_processes(files, tmp_path):
    """The CLI as its own process (not a fork): a broken draft / target is exit 1 with one
    ``Error:`` line, no traceback, no signal."""
    t, d = layout_of(files["target"]), layout_of(files["draft"])
    bad_draft = tmp_path / "bad-draft.gguf"
    bad_draft.write_bytes(apply_ops(open(files["draft"], "rb").read(),
                                    [["u32", _kv(d, "dflash.block_count")["value_at"], 1000]]))
    bad_target = tmp_path / "bad-target.gguf"
    bad_target.write_bytes(apply_ops(open(files["target"], "rb").read(), [["truncate", t.tinfo_end - 3]]))
    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    for args in (["inspect", str(bad_draft), "--target", files["target"]],
                 ["run", "-m", files["target"], "-md", str(bad_draft), "-p", "hi", "-n", "1", "-c", "64", "-t", "1"],
                 ["run", "-m", str(bad_target), "-md", files["draft"], "-p", "hi", "-n", "1", "-c", "64", "-t", "1"]):
        p = subprocess.run([sys.executable, "-m", "pyllama_dspark.cli.main", *args], capture_output=True, text=True,
                           timeout=300, env=env)
        errors = [ln for ln in p.stderr.splitlines() if ln.startswith("Error:")]
        assert p.returncode == 1 and len(errors) == 1 and "Traceback" not in p.stderr, (args, p.returncode, p.stderr)
