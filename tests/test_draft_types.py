"""Weight types of the random test drafts (``make-test-draft --type``, ``-md random:TYPE``,
``-md oracle:P:TYPE``; :mod:`pyllama_dspark.gguf.draft_types`).

* the types written, read back with gguf-py's ``GGUFReader`` (not our reader) and checked against
  tables written out here by hand from llama.cpp's converter / ``llama-quantize`` rules: norms,
  biases and 1-D tensors F32, the matrices in the type, rows that are not a multiple of 32 F16, and
  ``fc.weight`` never F16 (hazard 9: F32 where F16 would be chosen);
* the values: every type holds the BF16 draft's values (the random weights rounded to BF16, as a
  released checkpoint), F16 exactly, Q8_0 as gguf-py quantizes them, and Q4_0 byte for byte what
  llama.cpp's own quantizer (``llama_model_quantize``) makes of the BF16 draft;
* each type loads in llama.cpp, drafts, and the greedy output stays ``llama_cpp.Llama``'s;
* the command line: ``make-test-draft`` writes BF16 unless ``--type`` says otherwise, ``-md
  random:TYPE`` / ``oracle:P:TYPE`` write a cached draft per type, an unknown type is a usage error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from cli_runner import cli
from greedy_ref import TEST_THREADS

from pyllama_dspark.drafts.spec import parse_draft
from pyllama_dspark.gguf.draft_types import DEFAULT_DRAFT_TYPE, DRAFT_TYPES
from pyllama_dspark.gguf.testing import make_test_draft

QT = gguf.GGMLQuantizationType
TYPES = ("bf16", "f32", "f16", "q8_0", "q4_0")
FT = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "bf16": 32}          # enum llama_ftype (include/llama.h)
NORMS = ("enc.output_norm.weight", "output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight",
         "blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight")
MATRICES = ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight",
            "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight")


_READERS: dict = {}


def _reader(path) -> gguf.GGUFReader:
    """gguf-py's reader, once per file (it spends seconds on a 49k-token vocabulary)."""
    key = (str(path), os.stat(path).st_mtime_ns)
    if key not in _READERS:
        _READERS[key] = gguf.GGUFReader(str(path))
    return _READERS[key]


def _types(path) -> dict:
    return {t.name: t.tensor_type.name for t in _reader(path).tensors}


def _values(path) -> dict:
    """Every tensor dequantized to F32 by gguf-py, flat."""
    return {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)
            for t in _reader(path).tensors}


def _raw(t) -> bytes:
    return np.ascontiguousarray(t.data).tobytes()


@pytest.fixture(scope="module")
def drafts(target_path, tmp_path_factory):
    """A 1-layer DSpark draft (rank 32, the default) of each type, same seed."""
    d = tmp_path_factory.mktemp("types")
    return {wt: make_test_draft(target_path, d / f"{wt}.gguf", n_layers=1, seed=5, weight_type=wt) for wt in TYPES}


# ---- the types, by hand --------------------------------------------------------------------

EXPECTED = {   # SmolLM2: every row (576, 5 x 576, 1536, rank 32, 576 + 32) is a multiple of 32
    "bf16": dict(matrix="BF16", fc="BF16", markov="BF16", conf="BF16"),
    "f32": dict(matrix="F32", fc="F32", markov="F32", conf="F32"),
    "f16": dict(matrix="F16", fc="F32", markov="F16", conf="F16"),      # fc: hazard 9
    "q8_0": dict(matrix="Q8_0", fc="Q8_0", markov="Q8_0", conf="Q8_0"),  # convert_hf_to_gguf --outtype q8_0
    "q4_0": dict(matrix="Q4_0", fc="Q4_0", markov="Q4_0", conf="BF16"),  # llama-quantize keeps 1-row tensors
}


@pytest.mark.parametrize("wt", TYPES)
def test_tensor_types_are_llama_cpps(drafts, wt):
    types, want = _types(drafts[wt]), EXPECTED[wt]
    for n in NORMS + ("conf_proj.bias",):
        assert types[n] == "F32", (n, types[n])
    for n in MATRICES:
        assert types[n] == want["matrix"], (n, types[n])
    assert types["fc.weight"] == want["fc"]
    assert types["markov_w1.weight"] == types["markov_w2.weight"] == want["markov"]
    assert types["conf_proj.weight"] == want["conf"]
    assert len(types) == len(NORMS) + len(MATRICES) + 5
    assert int(_reader(drafts[wt]).fields["general.file_type"].contents()) == FT[wt]


def test_sizes_follow_the_type(drafts):
    size = {wt: os.path.getsize(p) for wt, p in drafts.items()}
    assert size["q4_0"] < size["q8_0"] < size["bf16"] < size["f16"] < size["f32"]   # f16 keeps fc in F32
    assert 0.45 < size["bf16"] / size["f32"] < 0.55


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A random qwen3 target with a 512-token vocabulary (the type tables need no real weights)."""
    from pyllama_dspark.gguf.target_writer import make_test_target

    return make_test_target(tmp_path_factory.mktemp("tiny") / "t.gguf", "qwen3", n_vocab=512, seed=2)


def test_rows_that_do_not_fit_a_block_fall_back_and_fc_never_becomes_f16(tiny_target, tmp_path):
    """Rank 8 (Markov rows of 8, conf_proj rows of 48 + 8), a 48-wide draft over three layer inputs
    (fc rows of 144): Q8_0 / Q4_0 fall back to F16 as llama.cpp's tools do, except fc (F32)."""
    kw = dict(n_layers=1, markov_rank=8, target_layers=[1, 2, 3], overrides={"@n_embd": 48, "@n_ff": 64,
                                                                             "@head_dim": 64, "@n_head": 1})
    for wt in ("q8_0", "q4_0", "f16", "bf16"):
        types = _types(make_test_draft(tiny_target, tmp_path / f"{wt}.gguf", weight_type=wt, **kw))
        blocked = wt in ("q8_0", "q4_0")
        assert types["fc.weight"] == ("F32" if blocked or wt == "f16" else "BF16"), (wt, types["fc.weight"])
        assert types["markov_w1.weight"] == types["markov_w2.weight"] == ("F16" if blocked else wt.upper())
        assert types["blk.0.attn_q.weight"] == ("F16" if blocked else wt.upper())    # rows of 48
        assert types["blk.0.ffn_down.weight"] == {"q8_0": "Q8_0", "q4_0": "Q4_0"}.get(wt, wt.upper())  # rows of 64
        assert types["conf_proj.weight"] == {"q8_0": "F16", "q4_0": "BF16"}.get(wt, wt.upper())
        assert types["output_norm.weight"] == "F32"


def test_fc_type_still_forces_fc(tiny_target, tmp_path):
    """``fc_type`` is how tests write a broken draft on purpose (hazard 9), whatever the type."""
    types = _types(make_test_draft(tiny_target, tmp_path / "f.gguf", n_layers=1, markov_rank=32,
                                   overrides={"@n_ff": 64}, weight_type="q8_0", fc_type="f16"))
    assert types["fc.weight"] == "F16" and types["blk.0.ffn_up.weight"] == "Q8_0"


# ---- the values ----------------------------------------------------------------------------

def test_every_type_holds_the_bf16_drafts_values(drafts):
    bf = _values(drafts["bf16"])
    f32, f16 = _values(drafts["f32"]), _values(drafts["f16"])
    q8 = _reader(drafts["q8_0"])
    for name, v in bf.items():
        # f32: the unrounded weights (BF16 keeps 8 bits of mantissa)
        np.testing.assert_allclose(f32[name], v, rtol=2.0 ** -8, atol=0, err_msg=name)
        assert np.array_equal(f16[name], v.astype(np.float16).astype(np.float32)) or name == "fc.weight", name
    assert np.array_equal(f16["fc.weight"], bf["fc.weight"])       # F32 there, the BF16 values exactly
    for t in q8.tensors:
        if t.tensor_type == QT.Q8_0:
            want = gguf.quants.quantize(bf[t.name].reshape(-1, 32), QT.Q8_0)
            assert _raw(t) == want.tobytes(), t.name


def test_q4_0_is_llama_quantize_of_the_bf16_draft(drafts, tmp_path):
    """llama.cpp's own quantizer (llama_model_quantize, LLAMA_FTYPE_MOSTLY_Q4_0) on the BF16 draft
    writes the same tensors, types and bytes (it stores the one-row conf_proj as 1-D: same data)."""
    from pyllama_dspark.llama.quantize import quantize_gguf

    ref = quantize_gguf(drafts["bf16"], tmp_path / "llama-q4_0.gguf", "q4_0", nthread=TEST_THREADS)
    a = {t.name: t for t in _reader(ref).tensors}
    b = {t.name: t for t in _reader(drafts["q4_0"]).tensors}
    assert set(a) == set(b)
    for name in a:
        assert (a[name].tensor_type, _raw(a[name])) == (b[name].tensor_type, _raw(b[name])), name
    ft = _reader(ref).fields["general.file_type"].contents()
    assert ft == _reader(drafts["q4_0"]).fields["general.file_type"].contents() == FT["q4_0"]


# ---- llama.cpp: loads, drafts, lossless ----------------------------------------------------

@pytest.mark.parametrize("wt", TYPES)
def test_each_type_drafts_in_llama_cpp_and_stays_greedy(drafts, wt, target_path, llama_refs):
    from pyllama_dspark.decode.api import Speculator

    prompt = llama_refs.llm.tokenize(b"The capital of France is", add_bos=True, special=True)
    with Speculator(target_path, drafts[wt], n_ctx=512, n_threads=TEST_THREADS, schedule="off") as sp:
        done = sp.generate(prompt, 16)
    assert done.stats.drafted > 0
    assert done.tokens == llama_refs.greedy(prompt, 16)


# ---- the -md grammar ------------------------------------------------------------------------

def test_parse_draft():
    """Every -md form, parsed in one place (drafts/spec.py) into one value."""
    def fields(s):
        d = parse_draft(s)
        return (d.path, d.random_kind, d.oracle_p, d.weight_type, d.dflash_mode)

    assert fields("random") == (None, "dspark", None, None, False)
    assert fields("random:q8_0") == (None, "dspark", None, "q8_0", False)
    assert fields("random-dspark") == (None, "dspark", None, None, False)
    assert fields("random-dflash:Q4_0") == (None, "dflash", None, "q4_0", False)
    assert fields("oracle:0.9") == (None, None, 0.9, None, False)
    assert fields("oracle:0.9:f16") == (None, None, 0.9, "f16", False)
    assert fields("oracle:1") == (None, None, 1.0, None, False)
    assert fields("draft.gguf") == ("draft.gguf", None, None, None, False)
    assert fields("oracle.gguf") == ("oracle.gguf", None, None, None, False)      # a file, not an oracle
    assert fields(Path("d/x.gguf")) == (os.path.join("d", "x.gguf"), None, None, None, False)
    assert parse_draft(None) is None and parse_draft("random").text == "random"
    d = parse_draft("random:f16", dflash_mode=True)
    assert d.dflash_mode and parse_draft(d) is d and parse_draft(parse_draft("x.gguf"), dflash_mode=True).dflash_mode
    assert parse_draft("oracle:0.5").is_oracle and not parse_draft("random").is_oracle
    for bad in ("random:q9", "random:", "random:q8_0:x", "oracle:0.9:bf17", "oracle:0.9:"):
        with pytest.raises(ValueError, match="type"):
            parse_draft(bad)
    for bad in ("oracle", "oracle:", "oracle:x", "oracle:1.5", "oracle:-0.1"):
        with pytest.raises(ValueError, match=r"oracle:P|P must be in \[0, 1\]"):
            parse_draft(bad)
    assert DEFAULT_DRAFT_TYPE == "bf16" and DRAFT_TYPES[0] == DEFAULT_DRAFT_TYPE


# ---- the command line ------------------------------------------------------------------------

def test_make_test_draft_is_bf16_unless_asked(target_path, tmp_path):
    small = ["--target", target_path, "--layers", "1", "--markov-rank", "32"]
    p = cli("make-test-draft", *small, "-o", tmp_path / "d.gguf")
    assert p.returncode == 0, p.stderr[-2000:]
    types = _types(tmp_path / "d.gguf")
    assert types["fc.weight"] == types["blk.0.attn_q.weight"] == "BF16" and types["output_norm.weight"] == "F32"
    p = cli("make-test-draft", *small, "-o", tmp_path / "q.gguf", "--type", "q4_0")
    assert p.returncode == 0, p.stderr[-2000:]
    assert _types(tmp_path / "q.gguf")["blk.0.ffn_up.weight"] == "Q4_0"
    p = cli("make-test-draft", *small, "-o", tmp_path / "x.gguf", "--type", "q5_0")
    assert p.returncode == 2 and "q5_0" in p.stderr and not (tmp_path / "x.gguf").exists()


def _run(target_path, cache, md, n=12):
    p = cli("run", "-m", target_path, "-md", md, "-p", "The capital of France is", "--raw", "-n", n, "--temp", "0",
            "-t", TEST_THREADS, "-c", "512", "--schedule", "off", "--json", env={"PYLLAMA_DSPARK_CACHE": str(cache)})
    return p


def test_md_random_and_oracle_take_a_type(target_path, llama_refs, tmp_path):
    cache = tmp_path / "cache"
    prompt = llama_refs.llm.tokenize(b"The capital of France is", add_bos=True, special=True)
    want = llama_refs.greedy(prompt, 12)
    for md, name, fc in (("random", "random-dspark-*-bf16.gguf", "BF16"),
                         ("random:q8_0", "random-dspark-*-q8_0.gguf", "Q8_0"),
                         ("oracle:0.9:q4_0", "random-dspark-*-q4_0.gguf", "Q4_0")):
        p = _run(target_path, cache, md)
        assert p.returncode == 0, (md, p.stderr[-3000:])
        out = json.loads(p.stdout)
        assert out["tokens"] == want and out["stats"]["drafted"] > 0, md
        written = list(cache.glob(name))
        assert len(written) == 1, (md, sorted(x.name for x in cache.iterdir()))
        assert _types(written[0])["fc.weight"] == fc, md
    assert len(list(cache.glob("random-*.gguf"))) == 3      # one file per type, none rewritten
    p = _run(target_path, cache, "random:q8_0", n=4)
    assert p.returncode == 0 and len(list(cache.glob("random-*.gguf"))) == 3
    for md in ("random:int4", "oracle:0.9:bf17"):
        p = _run(target_path, cache, md, n=4)
        assert p.returncode == 2 and "unknown draft weight type" in p.stderr and "Traceback" not in p.stderr, md


def test_a_bf16_draft_with_planted_bigrams_accepts_and_stays_greedy(target_path, tiny_target, llama_refs, tmp_path):
    """The BF16 Markov head takes planted bigrams (plant_markov_bigrams writes BF16 bits): llama.cpp's
    in-graph chain proposes the target's continuation, partly accepted, and the output is still
    Llama's greedy output."""
    from pyllama_dspark.decode.api import Speculator
    from pyllama_dspark.gguf.testing import plant_markov_bigrams

    prompt = llama_refs.llm.tokenize(b"The capital of France is", add_bos=True, special=True)
    want = llama_refs.greedy(prompt, 24)
    path = make_test_draft(target_path, tmp_path / "bigram-bf16.gguf", n_layers=1, markov_rank=64, seed=3,
                           weight_type="bf16")
    assert plant_markov_bigrams(path, [list(prompt) + want], drop_every=5) > 5
    with Speculator(target_path, path, n_ctx=512, n_threads=TEST_THREADS, schedule="off") as sp:
        done = sp.generate(prompt, 24)
    assert done.tokens == want
    assert done.stats.accepted >= 5 and any(0 < a < d for d, a in zip(done.stats.verify_lengths,
                                                                          done.stats.cycle_accepted))
    q8 = make_test_draft(tiny_target, tmp_path / "q8.gguf", n_layers=1, weight_type="q8_0")
    with pytest.raises(ValueError, match="F32 or BF16"):
        plant_markov_bigrams(q8, [[1, 2, 3]])
