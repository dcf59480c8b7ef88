"""``convert`` / ``export``: HF drafter checkpoints <-> draft GGUFs.

References: the draft GGUFs themselves (export -> convert must give them back bit for bit),
decoding with them, and llama.cpp's own converter (the vendored ``convert_hf_to_gguf.py``) run on
the checkpoints we export, with an HF target directory rebuilt from the target GGUF.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from pyllama_dspark.cli.main import main as cli
from pyllama_dspark.gguf.info import SOURCE_PREFIX
from pyllama_dspark.gguf.reader import field_value, read_gguf
from pyllama_dspark.gguf.testing import make_test_draft
from pyllama_dspark.gguf.write import raw_field
from pyllama_dspark.interop.convert import convert_checkpoint
from pyllama_dspark.interop.export import export_checkpoint
from pyllama_dspark.paths import default_draft
from pyllama_dspark.upstream.llama_server_build import vendored_llama_cpp

LLAMA_CPP_SRC = ""   # set by the hf_target fixture (the installed llama-cpp-python's vendored sources)


def _meta(path, provenance=False):
    """Metadata without convert's provenance keys (``pyllama_dspark.source.*``): export does not carry
    them, so export -> convert restores every other key exactly and writes provenance of its own."""
    r = read_gguf(path, use_cache=False)
    return {k: raw_field(r, k) for k in r.fields
            if not k.startswith("GGUF.") and (provenance or not k.startswith(SOURCE_PREFIX))}, r


def _prov(path, key):
    return field_value(read_gguf(path, use_cache=False), SOURCE_PREFIX + key, None)


def _tensors(r):
    return {t.name: (t.tensor_type.name, bytes(t.data)) for t in r.tensors}


def assert_same_gguf(a, b):
    ma, ra = _meta(a)
    mb, rb = _meta(b)
    assert list(ma) == list(mb)
    for k in ma:
        assert ma[k] == mb[k], k
    assert [t.name for t in ra.tensors] == [t.name for t in rb.tensors]
    ta, tb = _tensors(ra), _tensors(rb)
    for n in ta:
        assert ta[n][0] == tb[n][0], n
        assert ta[n][1] == tb[n][1], n


def _roundtrip(src, target, tmp_path, tag="rt"):
    ck = export_checkpoint(src, tmp_path / f"{tag}-ck")
    out = convert_checkpoint(ck, target, tmp_path / f"{tag}.gguf")
    return ck, out


# ---------------------------------------------------------------- round trips

@pytest.fixture(scope="module")
def shipped(tmp_path_factory, target_path):
    """The shipped drafter exported once, and converted back: (source, checkpoint dir, round trip)."""
    d = tmp_path_factory.mktemp("shipped")
    ck, out = _roundtrip(default_draft(), target_path, d)
    return default_draft(), ck, out


def _copy(ck, dst):
    import shutil

    return shutil.copytree(ck, dst)


def test_shipped_drafter_roundtrip_is_bit_exact(shipped):
    """Reduced vocabulary (d2t, own lm_head), F16 matrices, F32 fc: back bit for bit."""
    src, ck, out = shipped
    cfg = json.load(open(os.path.join(ck, "config.json")))
    assert cfg["dflash_config"]["target_layer_ids"] == [i - 1 for i in field_value(read_gguf(src),
                                                                                   "dflash.target_layers")]
    assert cfg["draft_vocab_size"] == 7320 and cfg["architectures"] == ["DSparkDraftModel"]
    from safetensors.numpy import load_file

    st = load_file(os.path.join(ck, "model.safetensors"))
    d2t_abs = np.array(read_gguf(src).tensors[-1].data)
    assert np.array_equal(st["d2t"] + np.arange(st["d2t"].size), d2t_abs)      # offsets in the checkpoint
    assert st["t2d"].sum() == 7320 and st["lm_head.weight"].shape == (7320, 576)
    assert_same_gguf(src, out)
    assert _prov(out, "outtype") == "auto"
    assert _prov(out, "config") == open(os.path.join(ck, "config.json"), encoding="utf-8").read()
    assert not any(k.startswith(SOURCE_PREFIX) for k in _meta(src, provenance=True)[0])   # shipped: none


def test_mixed_types_roundtrip_q8_0_requantizes_bit_exact(tmp_path, target_path):
    rng = np.random.default_rng(1)
    w = {"blk.0.attn_q.weight": (rng.standard_normal((576, 576), dtype=np.float32) * 0.05, "q8_0"),
         "blk.0.ffn_up.weight": (rng.standard_normal((1536, 576), dtype=np.float32) * 0.05, "f16"),
         "blk.1.attn_k.weight": (rng.standard_normal((192, 576), dtype=np.float32) * 0.05, "bf16")}
    src = make_test_draft(target_path, tmp_path / "mixed.gguf", kind="dspark", fc_type="q8_0", weights=w)
    ck, out = _roundtrip(src, target_path, tmp_path)
    from safetensors import safe_open

    with safe_open(os.path.join(ck, "model.safetensors"), "numpy") as f:
        assert str(f.get_slice("layers.0.self_attn.q_proj.weight").get_dtype()) == "F32"   # Q8_0 -> F32
        assert str(f.get_slice("layers.0.mlp.up_proj.weight").get_dtype()) == "F16"
    types = {t.name: t.tensor_type.name for t in read_gguf(out, use_cache=False).tensors}
    assert types["fc.weight"] == "Q8_0" and types["blk.1.attn_k.weight"] == "BF16"
    assert_same_gguf(src, out)


def test_bf16_checkpoint_stays_bf16_bit_exact(small_ck, tmp_path, target_path):
    """A released checkpoint is BF16: outtype auto keeps every matrix BF16 (fc.weight: F32, exactly)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    ck = shutil.copytree(small_ck, tmp_path / "bf16")
    _edit_config(ck, lambda c: {k: v for k, v in c.items() if k != "pyllama_dspark"})
    st = load_file(os.path.join(ck, "model.safetensors"))
    st = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in st.items()}
    save_file(st, os.path.join(ck, "model.safetensors"))
    out = convert_checkpoint(ck, target_path, tmp_path / "bf16.gguf")
    t = {x.name: x for x in read_gguf(out, use_cache=False).tensors}
    q = st["layers.0.self_attn.q_proj.weight"]
    assert t["blk.0.attn_q.weight"].tensor_type.name == "BF16"
    assert bytes(t["blk.0.attn_q.weight"].data) == q.view(torch.int16).numpy().tobytes()
    assert t["fc.weight"].tensor_type.name == "F32"
    assert np.array_equal(np.array(t["fc.weight"].data), st["fc.weight"].float().numpy())
    m, _ = _meta(out)
    assert m["general.file_type"][0] == 32          # MOSTLY_BF16, as llama.cpp's --outtype auto guesses


def test_roundtripped_draft_decodes_the_same(shipped, target_path):
    from pyllama_dspark.decode.api import Speculator

    src, _, out = shipped
    runs = []
    for draft in (src, out):
        # one thread: with 2 cores shared, a second llama.cpp thread makes decoding ~10x slower
        with Speculator(target_path, draft, n_ctx=512, n_threads=1, schedule="off") as sp:
            prompt = sp.chat_prompt([{"role": "user", "content": "Write a short poem about the sea."}]).tokens
            done = sp.generate(prompt, 32)
            runs.append((list(done.tokens), list(done.stats.verify_lengths), list(done.stats.cycle_accepted)))
    assert runs[0] == runs[1]
    assert sum(runs[0][1]) > 0          # it really drafted


# ---------------------------------------------------------------- schemas

def _edit_config(ck, fn):
    p = os.path.join(ck, "config.json")
    cfg = json.load(open(p))
    new = fn(cfg)
    cfg = new if isinstance(new, dict) else cfg
    json.dump(cfg, open(p, "w"))


def _flat(cfg):
    dfc = cfg.pop("dflash_config")
    cfg.update(target_layer_ids=dfc["target_layer_ids"], mask_token_id=dfc["mask_token_id"], is_causal=False)


def _speculators(cfg):
    keep = ("architectures", "pyllama_dspark", "vocab_size", "draft_vocab_size", "markov_head_type", "block_size")
    layer_cfg = {k: v for k, v in cfg.items() if k not in keep and k != "dflash_config"}
    dfc = cfg["dflash_config"]
    out = {k: cfg[k] for k in keep if k in cfg}
    out.update(architectures=["DSparkSpeculator"], transformer_layer_config=layer_cfg, is_causal=False,
               aux_hidden_state_layer_ids=[i + 1 for i in dfc["target_layer_ids"]], mask_token_id=dfc["mask_token_id"])
    return out


def test_flat_and_speculators_schemas(shipped, tmp_path, target_path):
    src = shipped[0]
    ck = _copy(shipped[1], tmp_path / "ck")
    _edit_config(ck, _flat)
    assert_same_gguf(src, convert_checkpoint(ck, target_path, tmp_path / "flat.gguf"))
    ck = _copy(shipped[1], tmp_path / "ck2")
    _edit_config(ck, _speculators)
    out = convert_checkpoint(ck, target_path, tmp_path / "spec.gguf")
    m, _ = _meta(out)
    assert m["dflash.sample_from_anchor"][0] is False          # speculators default: the 1+N bonus block
    assert m["dflash.target_layers"][0] == field_value(read_gguf(src), "dflash.target_layers")


def test_dflash_no_confidence_sharded_and_model_prefix(tmp_path, target_path):
    from safetensors.numpy import load_file, save_file

    for kind, conf in (("dflash", True), ("dspark", False)):
        src = make_test_draft(target_path, tmp_path / f"{kind}.gguf", kind=kind, confidence=conf, seed=3)
        ck = export_checkpoint(src, tmp_path / f"{kind}-ck")
        st = load_file(os.path.join(ck, "model.safetensors"))
        os.unlink(os.path.join(ck, "model.safetensors"))
        names = sorted(st)
        shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        wmap = {}
        for fname, part in shards.items():
            save_file({"model." + n: st[n] for n in part}, os.path.join(ck, fname))
            wmap.update({"model." + n: fname for n in part})
        json.dump({"metadata": {}, "weight_map": wmap}, open(os.path.join(ck, "model.safetensors.index.json"), "w"))
        out = convert_checkpoint(ck, target_path, tmp_path / f"{kind}-rt.gguf")
        assert_same_gguf(src, out)
        m, r = _meta(out)
        assert ("dflash.sample_from_anchor" in m) == (kind == "dspark")
        if kind == "dspark":
            assert m["dflash.has_confidence_head"][0] is False and "conf_proj.weight" not in _tensors(r)


# ---------------------------------------------------------------- validation (CLI: exit 1, message, no traceback)

@pytest.fixture(scope="module")
def small_ck(tmp_path_factory, target_path):
    d = tmp_path_factory.mktemp("val")
    src = make_test_draft(target_path, d / "small.gguf", kind="dspark", n_layers=1, seed=5)
    return export_checkpoint(src, d / "ck")


def _broken(small_ck, tmp_path, config=None, tensors=None, truncate=None):
    import shutil

    from safetensors.numpy import load_file, save_file

    ck = str(tmp_path / "broken")
    shutil.copytree(small_ck, ck)
    if config:
        _edit_config(ck, config)
    st_path = os.path.join(ck, "model.safetensors")
    if tensors:
        st = load_file(st_path)
        tensors(st)
        save_file(st, st_path)
    if truncate:
        data = open(st_path, "rb").read()
        data = data[:-truncate] if truncate > 0 else data[:8] + b"{not json" + data[17:]
        open(st_path, "wb").write(data)
    return ck


def _layer_ids(cfg, ids):
    cfg["dflash_config"]["target_layer_ids"] = ids


CASES = {
    "truncated": (dict(truncate=1000), "truncated or corrupt"),
    "missing": (dict(tensors=lambda st: st.pop("layers.0.mlp.up_proj.weight")), "layers.0.mlp.up_proj.weight"),
    "extra": (dict(tensors=lambda st: st.update({"layers.7.mlp.up_proj.weight": np.zeros((2, 2), np.float32)})),
              "layers.7.mlp.up_proj.weight"),
    "shape": (dict(tensors=lambda st: st.update({"fc.weight": np.zeros((576, 576), np.float32)})), "fc.weight"),
    "layer_id": (dict(config=lambda c: _layer_ids(c, [1, 8, 29])), "target_layer_ids"),
    "markov": (dict(config=lambda c: c.update(markov_head_type="gated")), "markov_head_type"),
    "hidden": (dict(config=lambda c: c.update(hidden_size=512)), "hidden_size"),
    "vocab": (dict(config=lambda c: c.update(vocab_size=32000)), "vocab_size"),
    "no_key": (dict(config=lambda c: c.pop("intermediate_size")), "intermediate_size"),
    "d2t_dup": (dict(config=lambda c: c.update(draft_vocab_size=49000),
                     tensors=lambda st: st.update(d2t=-np.arange(49000, dtype=np.int64),
                                                  **{"lm_head.weight": np.zeros((49000, 576), np.float32),
                                                     "markov_head.markov_w2.weight": np.zeros((49000, 32),
                                                                                              np.float32)})),
                "d2t"),
    "corrupt": (dict(tensors=lambda st: None, truncate=-1), "truncated or corrupt"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_validation_errors_are_clean(case, small_ck, tmp_path, target_path):
    kw, needle = CASES[case]
    ck = _broken(small_ck, tmp_path, **kw)
    out = tmp_path / "out.gguf"
    res = CliRunner().invoke(cli, ["convert", ck, "--target", target_path, "-o", str(out)])
    assert res.exit_code == 1, res.output
    assert needle in res.output and "Traceback" not in res.output
    assert not out.exists() and not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_cli_export_then_convert(tmp_path, target_path):
    src = make_test_draft(target_path, tmp_path / "d.gguf", kind="dspark", n_layers=1, seed=6)
    r = CliRunner().invoke(cli, ["export", src, "-o", str(tmp_path / "ck")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["export", src, "-o", str(tmp_path / "ck")])
    assert r.exit_code == 1 and "not empty" in r.output
    r = CliRunner().invoke(cli, ["export", target_path, "-o", str(tmp_path / "ck-target")])
    assert r.exit_code == 1 and "not a dflash draft" in r.output and not (tmp_path / "ck-target").exists()
    r = CliRunner().invoke(cli, ["convert", str(tmp_path / "ck"), "--target", target_path, "-o",
                                 str(tmp_path / "rt.gguf")])
    assert r.exit_code == 0, r.output
    assert_same_gguf(src, tmp_path / "rt.gguf")


def test_inspect_shows_where_a_converted_draft_came_from(tmp_path, target_path):
    """convert records the checkpoint's config.json text and the outtype; inspect prints them; export
    leaves them out of the checkpoint (a new conversion records its own)."""
    src = make_test_draft(target_path, tmp_path / "d.gguf", kind="dspark", n_layers=1, seed=6)
    ck = export_checkpoint(src, tmp_path / "ck")
    _edit_config(ck, lambda c: dict({k: v for k, v in c.items() if k != "pyllama_dspark"},
                                    _name_or_path="acme/dspark-test-block7"))
    text = open(os.path.join(ck, "config.json"), encoding="utf-8").read()
    out = tmp_path / "q8.gguf"
    r = CliRunner().invoke(cli, ["convert", str(ck), "--target", target_path, "-o", str(out), "--outtype", "q8_0"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["inspect", str(out), "--target", target_path])
    assert r.exit_code == 0, r.output
    assert "  source:           pyllama-dspark convert, outtype q8_0\n" in r.output
    assert "['DSparkDraftModel'] (acme/dspark-test-block7)" in r.output
    shown = r.output.split("  source config.json:\n", 1)[1].splitlines()
    assert shown[:len(text.splitlines())] == ["    " + x for x in text.splitlines()]
    r = CliRunner().invoke(cli, ["inspect", src])
    assert r.exit_code == 0 and "source:           not recorded" in r.output and "source config" not in r.output
    ck2 = export_checkpoint(out, tmp_path / "ck2")
    assert "pyllama_dspark.source" not in open(os.path.join(ck2, "config.json")).read()
    rt = convert_checkpoint(ck2, target_path, tmp_path / "rt.gguf")
    assert _prov(rt, "outtype") == "auto"
    assert _prov(rt, "config") == open(os.path.join(ck2, "config.json"), encoding="utf-8").read()


# ---------------------------------------------------------------- llama.cpp's converter as the reference

def build_hf_target(target_gguf, out_dir):
    """An HF target directory (config.json, tokenizer.json, tokenizer_config.json) rebuilt from a
    SmolLM2-style GGUF (llama arch, GPT-2 BPE with SmolLM's digit-splitting pre-tokenizer)."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    r = read_gguf(target_gguf)
    a = field_value(r, "general.architecture")
    toks = field_value(r, "tokenizer.ggml.tokens")
    types = field_value(r, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field_value(r, "tokenizer.ggml.merges")]
    tok = Tokenizer(BPE({t: i for i, t in enumerate(toks)}, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(toks[i], special=True, normalized=False) for i, t in enumerate(types) if t == 3])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    special = lambda k: toks[int(field_value(r, f"tokenizer.ggml.{k}_token_id"))]   # noqa: E731
    json.dump({"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False,
               "add_bos_token": bool(field_value(r, "tokenizer.ggml.add_bos_token", False)),
               "bos_token": special("bos"), "eos_token": special("eos"), "unk_token": special("unknown"),
               "pad_token": special("padding"), "chat_template": field_value(r, "tokenizer.chat_template")},
              open(os.path.join(out_dir, "tokenizer_config.json"), "w"))
    g = lambda k: field_value(r, f"{a}.{k}")   # noqa: E731
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": g("embedding_length"),
               "num_hidden_layers": g("block_count"), "num_attention_heads": g("attention.head_count"),
               "num_key_value_heads": g("attention.head_count_kv"), "intermediate_size": g("feed_forward_length"),
               "max_position_embeddings": g("context_length"), "rms_norm_eps": g("attention.layer_norm_rms_epsilon"),
               "rope_theta": g("rope.freq_base"), "vocab_size": len(toks), "tie_word_embeddings": True,
               "bos_token_id": field_value(r, "tokenizer.ggml.bos_token_id"),
               "eos_token_id": field_value(r, "tokenizer.ggml.eos_token_id")},
              open(os.path.join(out_dir, "config.json"), "w"))
    return out_dir


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory, target_path):
    for mod in ("transformers", "tokenizers", "sentencepiece", "torch"):
        __import__(mod)   # llama.cpp's converter needs them (the test extra installs them)
    global LLAMA_CPP_SRC
    LLAMA_CPP_SRC = str(vendored_llama_cpp())   # downloaded and extracted on a fresh machine
    assert os.path.isfile(os.path.join(LLAMA_CPP_SRC, "convert_hf_to_gguf.py"))
    return build_hf_target(target_path, tmp_path_factory.mktemp("hf-target"))


def _reference(ck, hf_target, out, outtype):
    """llama.cpp's own converter (the vendored ``convert_hf_to_gguf.py``) on checkpoint ``ck``."""
    src = LLAMA_CPP_SRC or str(vendored_llama_cpp())
    res = subprocess.run([sys.executable, os.path.join(src, "convert_hf_to_gguf.py"), str(ck),
                          "--target-model-dir", str(hf_target), "--outfile", str(out), "--outtype", outtype],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def _target_embeddings(target_path):
    import gguf

    t = {t.name: t for t in read_gguf(target_path).tensors}["token_embd.weight"]
    return np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)


def _dflash2_case(tmp_path, target_path):
    """DFlash2: dynamic convolutions per layer and a candidate selector (shapes made up: neither
    converter checks them)."""
    from safetensors.numpy import load_file, save_file

    ck = export_checkpoint(make_test_draft(target_path, tmp_path / "d.gguf", kind="dflash", seed=8), tmp_path / "ck")
    _edit_config(ck, lambda c: (c.update(architectures=["DFlash2DraftModel"]), c["dflash_config"].update(
        conv_kernel_size=4, conv_group_size=8, selector_rank=16, selector_top_k=4)))
    st_path = os.path.join(ck, "model.safetensors")
    st = load_file(st_path)
    rng = np.random.default_rng(2)
    for i in range(2):
        for part in ("attention_conv", "mlp_conv"):
            st[f"layers.{i}.{part}.base_kernel"] = rng.standard_normal((72, 4), dtype=np.float32)
            st[f"layers.{i}.{part}.kernel_projection.weight"] = rng.standard_normal((288, 576), dtype=np.float32)
    st["candidate_selector.predecessor_codebook"] = rng.standard_normal((64, 16), dtype=np.float32)
    st["candidate_selector.successor_codebook"] = rng.standard_normal((64, 16), dtype=np.float32)
    st["candidate_selector.hidden_projection.weight"] = rng.standard_normal((16, 576), dtype=np.float32)
    save_file(st, st_path)
    return ck


def _mask_embedding_case(tmp_path, target_path, hf_target):
    """A MiMo-style DFlash draft (mask_embedding.pt); llama.cpp reads the target's embeddings from an
    HF target directory holding the target GGUF's (dequantized) table, so both start from one table."""
    import shutil

    import torch
    from safetensors.numpy import save_file

    ck = export_checkpoint(make_test_draft(target_path, tmp_path / "d.gguf", kind="dflash", seed=8), tmp_path / "ck")
    torch.save({"mask_token_id": 16, "embedding": torch.from_numpy(np.linspace(-1, 1, 576, dtype=np.float32))},
               os.path.join(ck, "mask_embedding.pt"))
    hf = shutil.copytree(hf_target, tmp_path / "hf-target")
    save_file({"model.embed_tokens.weight": _target_embeddings(target_path)}, os.path.join(hf, "model.safetensors"))
    return ck, hf


#: general.* keys llama.cpp derives from the directory name / parameter count; ours from the checkpoint
_GENERAL_DIFF = {"general.name", "general.size_label", "general.basename", "general.finetune"}


def assert_matches_reference(ours, ref, outtype):
    """Our conversion against llama.cpp's (``ref``): every key but the names llama.cpp derives from the
    folder, the same tensors bit for bit, fc.weight aside (ours stays F32).  Returns our (metadata,
    reader, tensors) and the tensors whose types differ."""
    mo, ro = _meta(ours)
    mr, rr = _meta(ref)
    assert set(mr) - set(mo) - _GENERAL_DIFF == set() and set(mo) - set(mr) == set()
    for k in mo:
        if k not in _GENERAL_DIFF:
            assert mo[k] == mr[k], k
    to, tr = _tensors(ro), _tensors(rr)
    assert sorted(to) == sorted(tr)          # same tensors (llama.cpp writes them in checkpoint order)
    differ = {n for n in to if to[n][0] != tr[n][0]}
    assert differ <= {"fc.weight"}          # our one deviation: fc.weight stays F32
    for n in set(to) - differ:
        assert to[n][1] == tr[n][1], n
    if differ:
        assert tr["fc.weight"][0] == outtype.upper() and to["fc.weight"][0] == "F32"
    return mo, ro, to, differ


def _options(cfg):
    """Every optional DFlash setting at once: SWA, logit scale + soft-capping, embedding scale, causal,
    interleaved RoPE, partial rotary factor, attention value scale."""
    cfg.update(use_sliding_window=True, sliding_window=64, layer_types=["sliding_attention", "full_attention"],
               output_multiplier=0.5, final_logit_softcapping=30.0, input_embedding_scale=2.0,
               rope_is_neox_style=False, partial_rotary_factor=0.5)
    cfg["dflash_config"].update(causal=True, attention_value_scale=0.75)


@pytest.mark.parametrize("variant,outtype", [("shipped", "f16"), ("speculators_noconf", "q8_0"), ("options", "bf16"),
                                             ("mask_embedding", "f32"), ("flat", "f32")])
def test_matches_llama_cpp_converter(variant, outtype, tmp_path, target_path, hf_target, shipped):
    if variant == "shipped":
        ck = _copy(shipped[1], tmp_path / "ck")
    elif variant == "mask_embedding":
        ck, hf_target = _mask_embedding_case(tmp_path, target_path, hf_target)
    elif variant == "flat":         # the flat DSpark schema (no dflash_config), Markov + confidence heads, d2t
        ck = _copy(shipped[1], tmp_path / "ck")
        _edit_config(ck, _flat)
    elif variant == "options":      # a DFlash2 draft with every optional setting
        ck = _dflash2_case(tmp_path, target_path)
        _edit_config(ck, _options)
    else:
        src = make_test_draft(target_path, tmp_path / "d.gguf", kind="dspark", confidence=False, seed=9)
        ck = export_checkpoint(src, tmp_path / "ck")
        _edit_config(ck, _speculators)
    for path in (ck,):
        cfg = json.load(open(os.path.join(path, "config.json")))
        cfg.pop("pyllama_dspark")          # a released checkpoint has no record of GGUF types
        json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    ref = _reference(ck, hf_target, tmp_path / "ref.gguf", outtype)
    ours = convert_checkpoint(ck, target_path, tmp_path / "ours.gguf", outtype=outtype)
    mo, ro, to, _ = assert_matches_reference(ours, ref, outtype)
    if variant == "mask_embedding":
        emb = np.array(ro.tensors[0].data) if ro.tensors[0].name == "token_embd.weight" else None
        tgt = _target_embeddings(target_path)
        vec = np.linspace(-1, 1, 576, dtype=np.float32)
        assert np.array_equal(emb[16], vec) and np.array_equal(np.delete(emb, 16, 0), np.delete(tgt, 16, 0))
    if variant == "options":       # and what we convert exports and converts back bit for bit
        assert mo["dflash.attention.causal"][0] is True and mo["dflash.rope.dimension_count"][0] == 32
        assert mo["dflash.selector_top_k"][0] == 4 and "blk.1.ffn_conv_base" in to
        ck2 = export_checkpoint(ours, tmp_path / "ck2")
        assert_same_gguf(ours, convert_checkpoint(ck2, target_path, tmp_path / "rt.gguf"))
