"""``make-test-target --size`` / ``--type``: real model shapes and llama.cpp's quantizer.

References, independent of our table (``pyllama_dspark.gguf.target_sizes``):

* ``PUBLISHED``: the models' own numbers, typed here from their ``config.json`` and model cards --
  Qwen3 cards "Number of Parameters: 0.6B / 1.7B / 4.0B / 8.2B", "Non-Embedding: 0.44B / 1.4B /
  3.6B / 6.95B"; Llama 3.2 card "1B (1.23B)", "3B (3.21B)"; Gemma 4 12B card 11.95B (the text decoder
  plus small vision / audio embedders).  The parameter count is summed over the tensor shapes the
  writer plans (no weights written);
* llama.cpp itself reading a written file (``llama_model_n_*``, generation), and gguf-py's reader
  for the tensor types llama.cpp's quantizer chose.
"""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
from click.testing import CliRunner

from pyllama_dspark.cli.main import main
from pyllama_dspark.gguf.target_writer import count_params, plan_test_target

# (arch, size): layers, width, heads, KV heads (sliding layers for gemma4), head size, FFN, vocab, tied,
# published total parameters, published non-embedding parameters (None: not published)
PUBLISHED = {
    ("qwen3", "0.6b"): (28, 1024, 16, 8, 128, 3072, 151936, True, 0.6e9, 0.44e9),
    ("qwen3", "1.7b"): (28, 2048, 16, 8, 128, 6144, 151936, True, 1.7e9, 1.4e9),
    ("qwen3", "4b"): (36, 2560, 32, 8, 128, 9728, 151936, True, 4.0e9, 3.6e9),
    ("qwen3", "8b"): (36, 4096, 32, 8, 128, 12288, 151936, False, 8.2e9, 6.95e9),
    ("llama", "1b"): (16, 2048, 32, 8, 64, 8192, 128256, True, 1.23e9, None),
    ("llama", "3b"): (28, 3072, 24, 8, 128, 8192, 128256, True, 3.21e9, None),
    ("gemma4", "12b"): (48, 3840, 16, 8, 256, 15360, 262144, True, 11.95e9, None),
}
# Gemma 4 12B's full-attention layers (every 6th): head 512, 1 KV head, K used as V (no v_proj)
G4_FULL = dict(head_dim=512, n_kv=1, every=6)


def _meta(meta, key):
    return meta[key][0]


@pytest.mark.parametrize("arch,size", list(PUBLISHED))
def test_size_matches_the_published_model(arch, size):
    layers, embd, heads, kv, hd, ff, vocab, tied, total_pub, non_emb_pub = PUBLISHED[(arch, size)]
    a, meta, plan = plan_test_target(arch, size=size)
    shapes = {t.name: t.shape for t in plan}
    total, non_emb = count_params(plan)
    print(f"{arch} {size}: {total / 1e9:.3f}B total (published {total_pub / 1e9}B), "
          f"{non_emb / 1e9:.3f}B non-embedding" + (f" (published {non_emb_pub / 1e9}B)" if non_emb_pub else ""))
    assert abs(total / total_pub - 1) < 0.02
    if non_emb_pub:
        assert abs(non_emb / non_emb_pub - 1) < 0.02
    assert _meta(meta, f"{a}.block_count") == layers
    assert _meta(meta, f"{a}.embedding_length") == embd
    assert _meta(meta, f"{a}.attention.head_count") == heads
    assert _meta(meta, f"{a}.feed_forward_length") == ff
    assert sum(1 for n in shapes if n.endswith(".attn_norm.weight")) == layers
    assert shapes["token_embd.weight"] == (vocab, embd)
    assert ("output.weight" in shapes) == (not tied)
    assert _meta(meta, "tokenizer.ggml.tokens").__len__() == vocab
    for il in range(layers):
        full = arch == "gemma4" and (il + 1) % G4_FULL["every"] == 0
        h, nkv = (G4_FULL["head_dim"], G4_FULL["n_kv"]) if full else (hd, kv)
        p = f"blk.{il}."
        assert shapes[p + "attn_q.weight"] == (heads * h, embd), p
        assert shapes[p + "attn_k.weight"] == (nkv * h, embd), p
        assert shapes.get(p + "attn_v.weight") == (None if full else (nkv * h, embd)), p
        assert shapes[p + "attn_output.weight"] == (embd, heads * h), p
        assert shapes[p + "ffn_gate.weight"] == (ff, embd) and shapes[p + "ffn_down.weight"] == (embd, ff), p
    if arch == "gemma4":
        kv_arr = _meta(meta, "gemma4.attention.head_count_kv")
        assert kv_arr == [G4_FULL["n_kv"] if (il + 1) % 6 == 0 else kv for il in range(layers)]
        assert _meta(meta, "gemma4.attention.key_length") == G4_FULL["head_dim"]
        assert _meta(meta, "gemma4.attention.key_length_swa") == hd
        assert _meta(meta, "gemma4.attention.sliding_window") == 1024
    else:
        assert _meta(meta, f"{a}.attention.head_count_kv") == kv
        assert _meta(meta, f"{a}.attention.key_length") == hd


def _tensor_types(path):
    """({tensor name: ggml type name}, general.file_type), read straight from the GGUF format (v3:
    header, key/values, tensor infos; gguf-py's GGUFReader takes ~6 s over a 151,936-token vocabulary)."""
    import struct

    import gguf

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    with open(path, "rb") as f:
        def rd(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def rstr():
            return f.read(rd("Q")).decode("utf-8", "replace")

        def value(vt):
            if vt == 8:
                return rstr()
            if vt == 9:
                sub, n = rd("I"), rd("Q")
                if sub in scalar:
                    f.seek(n * struct.calcsize(scalar[sub]), 1)
                else:
                    for _ in range(n):
                        value(sub)
                return None
            return rd(scalar[vt])

        assert f.read(4) == b"GGUF" and rd("I") == 3
        n_tensors, n_kv = rd("Q"), rd("Q")
        meta = {}
        for _ in range(n_kv):
            key = rstr()
            meta[key] = value(rd("I"))
        types = {}
        for _ in range(n_tensors):
            name = rstr()
            f.seek(8 * rd("I"), 1)
            types[name] = gguf.GGMLQuantizationType(rd("I")).name
            rd("Q")
    return types, int(meta["general.file_type"])


def _load_and_generate(path, n_tokens=4):
    """llama.cpp's view of the file: (n_layer, n_embd, n_head, n_head_kv, n_vocab), and the last logits
    after greedily generating a few tokens (all finite)."""
    import llama_cpp

    llm = llama_cpp.Llama(path, n_ctx=64, n_batch=64, verbose=False)
    try:
        m = llm.model
        dims = (llama_cpp.llama_model_n_layer(m), llama_cpp.llama_model_n_embd(m), llama_cpp.llama_model_n_head(m),
                llama_cpp.llama_model_n_head_kv(m), llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(m)))
        toks = [1, 300, 301, 302]
        for _ in range(n_tokens):
            llm.eval(toks[-1:] if len(toks) > 4 else toks)
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()
            assert np.isfinite(logits).all()
            toks.append(int(np.argmax(logits)))
        return dims, logits
    finally:
        llm.close()


def test_real_qwen3_06b_q4_0_read_by_llama_cpp(tmp_path):
    """The real 0.6B shape (all 28 layers, 151,936-token vocabulary), Q4_0 from llama.cpp's quantizer."""
    out = tmp_path / "q06.gguf"
    r = CliRunner().invoke(main, ["make-test-target", "--arch", "qwen3", "--size", "0.6b", "--type", "q4_0",
                                  "--peaked", "4", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert sorted(os.listdir(tmp_path)) == ["q06.gguf"]           # the F16 temporary file is gone
    layers, embd, heads, kv, hd, ff, vocab = PUBLISHED[("qwen3", "0.6b")][:7]
    types, ftype = _tensor_types(str(out))
    assert ftype == 2                                              # LLAMA_FTYPE_MOSTLY_Q4_0
    mats = [n for n in types if n.startswith("blk.") and n.endswith(("attn_q.weight", "attn_k.weight",
                                                                     "attn_v.weight", "attn_output.weight",
                                                                     "ffn_gate.weight", "ffn_up.weight",
                                                                     "ffn_down.weight"))]
    assert len(mats) == 7 * layers and {types[n] for n in mats} == {"Q4_0"}
    assert "output.weight" not in types                            # tied
    assert {types[n] for n in types if n.endswith("norm.weight")} == {"F32"}
    dims, logits = _load_and_generate(str(out))
    assert dims == (layers, embd, heads, kv, vocab)
    print(f"0.6b q4_0: {os.path.getsize(out) / 2**20:.0f} MiB, logits std {logits.std():.2f}")
    assert 1.0 < logits.std() < 20.0                               # peaked x4, not degenerate


@pytest.mark.parametrize("qtype,dominant,file_type", [("f16", "F16", 1), ("q8_0", "Q8_0", 7), ("q4_0", "Q4_0", 2)])
def test_type_on_the_small_default_target(tmp_path, qtype, dominant, file_type):
    out = tmp_path / f"t-{qtype}.gguf"
    r = CliRunner().invoke(main, ["make-test-target", "--arch", "qwen3", "--n-vocab", "2048", "--type", qtype,
                                  "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert sorted(os.listdir(tmp_path)) == [out.name]
    types, ftype = _tensor_types(str(out))
    counts = collections.Counter(t for n, t in types.items() if not n.endswith("norm.weight"))
    assert ftype == file_type and counts.most_common(1)[0][0] == dominant, counts
    assert types["blk.0.attn_q.weight"] == types["blk.3.ffn_up.weight"] == dominant
    dims, _ = _load_and_generate(str(out), 2)
    assert dims == (4, 128, 4, 2, 2048)


def test_type_q4_k_m(tmp_path):
    """Q4_K_M needs rows of 256: a 256-wide small target (at width 128 llama.cpp falls back to Q5_0)."""
    from pyllama_dspark.llama.quantize import write_test_target

    out = write_test_target(tmp_path / "k.gguf", "qwen3", qtype="q4_k_m", n_vocab=2048, n_embd=256, head_dim=64,
                            n_ff=512)
    types, ftype = _tensor_types(out)
    counts = collections.Counter(t for n, t in types.items() if not n.endswith("norm.weight"))
    assert ftype == 15 and counts.most_common(1)[0][0] == "Q4_K", counts
    assert types["output.weight"] == "Q6_K" and "Q6_K" in {types[f"blk.{i}.ffn_down.weight"] for i in range(4)}
    dims, _ = _load_and_generate(out, 2)
    assert dims == (4, 256, 4, 2, 2048)


@pytest.mark.parametrize("args,code,needle", [
    (["--arch", "llama", "--size", "0.6b"], 2, "llama has no size 0.6b; choose one of 1b, 3b"),
    (["--arch", "qwen3moe", "--size", "8b"], 2, "no --size for this arch"),
    (["--arch", "qwen3", "--size", "9b"], 2, "'9b' is not one of"),
    (["--arch", "qwen3", "--size", "0.6b", "--n-vocab", "4096"], 2, "--n-vocab conflicts with --size"),
    (["--arch", "qwen3", "--type", "q4_0", "--vocab-type", "f32"], 2, "--vocab-type is for the small default"),
    (["--arch", "qwen3", "--type", "q5_1"], 2, "'q5_1' is not one of"),
    (["--arch", "qwen3", "--size", "0.6b", "--layers", "0"], 1, "n_layer must be >= 1"),
    (["--arch", "gemma4", "--size", "12b", "--peaked", "-1"], 1, "peaked must be a positive number"),
])
def test_bad_input_is_a_clear_cli_error(tmp_path, args, code, needle):
    r = CliRunner().invoke(main, ["make-test-target", "-o", str(tmp_path / "x.gguf")] + args)
    assert r.exit_code == code, r.output
    assert needle in r.output and "Traceback" not in r.output, r.output
    assert isinstance(r.exception, SystemExit)
    assert os.listdir(tmp_path) == []


def test_quantizer_failure_raises_and_cleans_up(tmp_path, monkeypatch):
    from pyllama_dspark.llama import quantize as q

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(q.QuantizeError, match="llama_model_quantize"):
        q.quantize_gguf(bad, tmp_path / "out.gguf", "q4_0")
    bad.unlink()
    for p in tmp_path.iterdir():
        p.unlink()

    def boom(*a, **k):
        raise q.QuantizeError("planted failure")

    monkeypatch.setattr(q, "quantize_gguf", boom)
    r = CliRunner().invoke(main, ["make-test-target", "--arch", "qwen3", "--n-vocab", "1024", "--type", "q8_0",
                                  "-o", str(tmp_path / "y.gguf")])
    assert r.exit_code == 1 and "planted failure" in r.output, r.output
    assert os.listdir(tmp_path) == []                                # no temporary or partial file left


# Qwen3.5-4B's text backbone, typed from its published config as the size table's docstring cites it:
# layers, width, heads, KV heads, head size, FFN, vocab, tied, Gated DeltaNet key / value heads and head
# size, full-attention interval
QWEN35_4B = dict(layers=32, embd=2560, heads=16, kv=4, hd=256, ff=9216, vocab=248320, tied=True,
                 lin_k=16, lin_v=32, lin_hd=128, interval=4)


def _qwen35_params(c):
    """Parameters of a Qwen3.5 text backbone, summed from its config by hand (the exact law)."""
    d, ff, v = c["embd"], c["ff"], c["vocab"]
    key, val = c["lin_k"] * c["lin_hd"], c["lin_v"] * c["lin_hd"]
    gdn = d * (2 * key + val) + (2 * key + val) * 4 + d * val + 2 * d * c["lin_v"] + 2 * c["lin_v"] \
        + c["lin_hd"] + val * d                      # qkv, conv, z gate, alpha / beta, dt bias + A, norm, out
    attn = d * 2 * c["heads"] * c["hd"] + 2 * d * c["kv"] * c["hd"] + c["heads"] * c["hd"] * d + 2 * c["hd"]
    per_layer = 3 * d * ff + 2 * d                   # SwiGLU, attn_norm, post_attention_norm
    n_attn = c["layers"] // c["interval"]
    return (v * d * (1 if c["tied"] else 2) + d + c["layers"] * per_layer + n_attn * attn
            + (c["layers"] - n_attn) * gdn)


def _planned_by_law(arch, size, law, c):
    """The planned target's (metadata, shapes), after checking its parameter count against ``law(c)``."""
    _, meta, plan = plan_test_target(arch, size=size)
    total, _ = count_params(plan)
    print(f"{arch} {size}: {total / 1e9:.3f}B parameters")
    assert total == law(c)
    return meta, {t.name: t.shape for t in plan}


def test_qwen35_4b_is_the_published_shape():
    c = QWEN35_4B
    meta, shapes = _planned_by_law("qwen35", "4b", _qwen35_params, c)
    assert _meta(meta, "qwen35.block_count") == c["layers"] and _meta(meta, "qwen35.embedding_length") == c["embd"]
    assert _meta(meta, "qwen35.attention.head_count") == c["heads"]
    assert _meta(meta, "qwen35.attention.head_count_kv") == c["kv"]
    assert _meta(meta, "qwen35.attention.key_length") == c["hd"]
    assert _meta(meta, "qwen35.rope.dimension_count") == c["hd"] // 4              # partial_rotary_factor 0.25
    assert _meta(meta, "qwen35.rope.freq_base") == 1e7
    assert _meta(meta, "qwen35.full_attention_interval") == c["interval"]
    assert (_meta(meta, "qwen35.ssm.group_count"), _meta(meta, "qwen35.ssm.time_step_rank"),
            _meta(meta, "qwen35.ssm.state_size")) == (c["lin_k"], c["lin_v"], c["lin_hd"])
    recurrent = _meta(meta, "qwen35.attention.recurrent_layers")
    assert recurrent == [(il + 1) % c["interval"] != 0 for il in range(c["layers"])]   # layer 3, 7, ... attention
    assert shapes["token_embd.weight"] == (c["vocab"], c["embd"]) and ("output.weight" in shapes) == (not c["tied"])
    for il in range(c["layers"]):
        p = f"blk.{il}."
        if recurrent[il]:
            assert shapes[p + "attn_qkv.weight"] == ((2 * c["lin_k"] + c["lin_v"]) * c["lin_hd"], c["embd"]), p
            assert shapes[p + "ssm_out.weight"] == (c["embd"], c["lin_v"] * c["lin_hd"]), p
        else:
            assert shapes[p + "attn_q.weight"] == (2 * c["heads"] * c["hd"], c["embd"]), p    # query + gate
            assert shapes[p + "attn_k.weight"] == (c["kv"] * c["hd"], c["embd"]), p
        assert shapes[p + "ffn_down.weight"] == (c["embd"], c["ff"]), p


# Nemotron-H-8B, typed from its config.json (Megatron-Bridge's copy, as the size table cites it)
NEMOTRON_H_8B = dict(layers=52, embd=4096, heads=32, kv=8, hd=128, ff=21504, vocab=131072, tied=False,
                     m_heads=128, m_hd=64, state=128, groups=8, conv=4,
                     pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-")


def _nemotron_h_params(c):
    d, d_in = c["embd"], c["m_heads"] * c["m_hd"]
    conv_ch = d_in + 2 * c["groups"] * c["state"]
    mamba = (d * (2 * d_in + 2 * c["groups"] * c["state"] + c["m_heads"]) + conv_ch * (c["conv"] + 1)
             + 3 * c["m_heads"] + d_in + d_in * d)       # in_proj, conv + bias, dt bias / A / D, norm, out_proj
    attn = 2 * d * c["heads"] * c["hd"] + 2 * d * c["kv"] * c["hd"]
    mlp = 2 * d * c["ff"]                                  # squared ReLU: up, down
    kinds = [c["pattern"][i % len(c["pattern"])] for i in range(c["layers"])]
    return (c["vocab"] * d * (1 if c["tied"] else 2) + d + c["layers"] * d
            + sum({"M": mamba, "*": attn, "-": mlp}[k] for k in kinds))


def test_nemotron_h_8b_is_the_published_shape():
    c = NEMOTRON_H_8B
    meta, shapes = _planned_by_law("nemotron_h", "8b", _nemotron_h_params, c)
    kv_arr = _meta(meta, "nemotron_h.attention.head_count_kv")
    ff_arr = _meta(meta, "nemotron_h.feed_forward_length")
    for il, letter in enumerate(c["pattern"]):
        assert (kv_arr[il], ff_arr[il]) == {"M": (0, 0), "*": (c["kv"], 0), "-": (0, c["ff"])}[letter], il
        p = f"blk.{il}."
        if letter == "M":
            d_in = c["m_heads"] * c["m_hd"]
            assert shapes[p + "ssm_in.weight"] == (2 * d_in + 2 * c["groups"] * c["state"] + c["m_heads"], c["embd"]), p
            assert shapes[p + "ssm_norm.weight"] == (c["groups"], d_in // c["groups"]), p
        elif letter == "*":
            assert shapes[p + "attn_q.weight"] == (c["heads"] * c["hd"], c["embd"]), p
            assert shapes[p + "attn_k.weight"] == (c["kv"] * c["hd"], c["embd"]), p
        else:
            assert shapes[p + "ffn_up.weight"] == (c["ff"], c["embd"]) and p + "ffn_gate.weight" not in shapes, p
    assert (_meta(meta, "nemotron_h.ssm.state_size"), _meta(meta, "nemotron_h.ssm.group_count"),
            _meta(meta, "nemotron_h.ssm.time_step_rank"), _meta(meta, "nemotron_h.ssm.inner_size")) == \
        (c["state"], c["groups"], c["m_heads"], c["m_heads"] * c["m_hd"])
    assert shapes["token_embd.weight"] == (c["vocab"], c["embd"]) and ("output.weight" in shapes) == (not c["tied"])
