"""``export`` takes every draft metadata key (it once refused ``dflash.vocab_size``).

References: llama.cpp's own converter (the vendored ``convert_hf_to_gguf.py``) and the key list of
the vendored gguf-py.

* A DSpark draft converted by llama.cpp's converter for a **Mistral-format target** (``tekken.json``,
  no ``tokenizer.json``: ``DFlashModel.set_vocab`` -> ``LlamaModel.set_vocab`` -> ``_set_vocab_mistral``,
  which writes ``dflash.vocab_size``) exports.  llama.cpp's converter, run on the export with the
  same target, writes the same draft again: every key, every tensor byte.
* A checkpoint with every optional standard setting llama.cpp's converter reads (YaRN RoPE scaling,
  a sliding-window RoPE base, a layer-norm epsilon, expert counts and gating): our ``convert``
  writes the keys llama.cpp's converter writes, and the draft llama.cpp made exports, and converts
  back, to the same keys with both converters.
* A draft carrying every ``{arch}.*`` key that the vendored gguf-py names: ``export`` then
  ``convert`` gives every key back with its value and GGUF type.  llama.cpp's converter, on the
  same export, gives back exactly the keys that ``export`` put into config fields; the rest are
  the keys ``export`` keeps in ``pyllama_dspark.gguf_keys`` (docs/interop.md).
"""

from __future__ import annotations

import base64
import importlib.util
import inspect
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pyllama_dspark.gguf.reader import read_gguf
from pyllama_dspark.gguf.testing import make_test_draft
from pyllama_dspark.gguf.write import raw_field, write_gguf
from pyllama_dspark.interop.checkpoint import CheckpointError
from pyllama_dspark.interop.convert import convert_checkpoint
from pyllama_dspark.interop.export import export_checkpoint
from pyllama_dspark.upstream.llama_server_build import vendored_llama_cpp
from test_interop import _GENERAL_DIFF, _edit_config, build_hf_target

#: mistral-common (llama.cpp's converter needs it for a Mistral tokenizer) pins numpy < 2.4 on
#: Python <= 3.12, so it is installed apart, without dependencies, for the converter's process only
MISTRAL_DEPS = ("mistral-common==1.13.1", "tiktoken==0.14.0", "pycountry==26.2.16", "pydantic-extra-types==2.11.1")


def _meta(path):
    """{key: (value, type, item type)} without the file header and our provenance keys."""
    r = read_gguf(path, use_cache=False)
    return {k: raw_field(r, k) for k in r.fields if not k.startswith(("GGUF.", "pyllama_dspark."))}, r


def _tensors(r):
    return {t.name: (t.tensor_type.name, bytes(t.data)) for t in r.tensors}


@pytest.fixture(scope="module")
def llama_cpp_src():
    for mod in ("transformers", "tokenizers", "sentencepiece", "torch"):
        __import__(mod)   # llama.cpp's converter needs them (the test extra installs them)
    return str(vendored_llama_cpp())


@pytest.fixture(scope="module")
def mistral_deps():
    """A folder with mistral-common and its missing dependencies (pip, once per cache)."""
    from pyllama_dspark.paths import cache_dir

    root = cache_dir() / "converter-deps" / "-".join(d.replace("==", "-") for d in MISTRAL_DEPS[:1])
    if not (root / ".complete").exists():
        tmp = root.with_name(root.name + f".tmp{os.getpid()}")
        res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp),
                              *MISTRAL_DEPS], capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        (tmp / ".complete").write_text("")
        if not root.exists():
            os.replace(tmp, root)
    return str(root)


def _llama_convert(src, ck, target_dir, out, outtype="f32", pythonpath=None):
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, os.path.join(src, "convert_hf_to_gguf.py"), str(ck), "--target-model-dir",
                          str(target_dir), "--outfile", str(out), "--outtype", outtype],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return str(out)


def _released(src, out):
    """``src`` exported as a released checkpoint would be: no record of GGUF types or keys."""
    ck = export_checkpoint(src, out)
    _edit_config(ck, lambda c: {k: v for k, v in c.items() if k != "pyllama_dspark"})
    return ck


def _assert_same(a, b, ignore=()):
    ma, ra = _meta(a)
    mb, rb = _meta(b)
    assert set(ma) - set(ignore) == set(mb) - set(ignore)
    for k in set(ma) - set(ignore):
        assert ma[k] == mb[k], k
    assert _tensors(ra) == _tensors(rb)


# ---------------------------------------------------------------- a Mistral-format target

def tekken_target(out_dir, n_vocab: int, hidden: int, n_special: int = 1000):
    """An HF Mistral target directory whose tokenizer is a ``tekken.json`` of ``n_vocab`` tokens
    (``n_special`` control tokens, then single bytes and byte pairs) and no ``tokenizer.json``."""
    os.makedirs(out_dir, exist_ok=True)
    toks = [bytes([b]) for b in range(256)]
    toks += [bytes(p) for p in itertools.islice(itertools.product(range(256), repeat=2), n_vocab - n_special - 256)]
    vocab = [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("latin-1")}
             for i, t in enumerate(toks)]
    pattern = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    with open(os.path.join(out_dir, "tekken.json"), "w") as f:
        json.dump({"config": {"pattern": pattern, "num_vocab_tokens": len(toks), "default_vocab_size": n_vocab,
                              "default_num_special_tokens": n_special, "version": "v7"}, "vocab": vocab}, f)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": hidden,
                   "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                   "intermediate_size": 1536, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                   "rope_theta": 1e6, "vocab_size": n_vocab}, f)
    return out_dir


def test_a_draft_for_a_mistral_target_exports(tmp_path, target_path, llama_cpp_src, mistral_deps):
    src = make_test_draft(target_path, tmp_path / "d.gguf", kind="dspark", n_layers=1, seed=3)
    mistral = tekken_target(tmp_path / "mistral-target", 49152, 576)
    ref = _llama_convert(llama_cpp_src, _released(src, tmp_path / "ck"), mistral, tmp_path / "ref.gguf",
                         pythonpath=mistral_deps)
    m, _ = _meta(ref)
    assert m["dflash.vocab_size"][0] == 49152 and m["tokenizer.ggml.pre"][0] == b"tekken"   # the Mistral handler ran
    ck = export_checkpoint(ref, tmp_path / "ck-ref")                                      # refused before
    cfg = json.load(open(os.path.join(ck, "config.json")))
    assert cfg["vocab_size"] == 49152
    assert cfg["pyllama_dspark"]["gguf_keys"] == {"dflash.vocab_size": [49152, "UINT32", None]}
    again = _llama_convert(llama_cpp_src, ck, mistral, tmp_path / "again.gguf", pythonpath=mistral_deps)
    _assert_same(ref, again, ignore={"general.name"})
    # a vocab_size that is not the token count is a clear error, not a checkpoint that lies
    m["dflash.vocab_size"] = (1234, m["dflash.vocab_size"][1], None)
    _, r = _meta(ref)
    bad = write_gguf(tmp_path / "bad.gguf", "dflash", {k: v for k, v in m.items() if k != "general.architecture"},
                     {t.name: (np.array(t.data), t.tensor_type) for t in r.tensors})
    with pytest.raises(CheckpointError, match="vocab_size 1234"):
        export_checkpoint(bad, tmp_path / "ck-bad")


# ---------------------------------------------------------------- the optional standard keys

def _standard_options(cfg):
    cfg.update(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                             "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.25},
               rope_local_base_freq=10000.0, layer_norm_eps=1e-6, num_experts=8, num_experts_per_tok=2,
               n_group=2, topk_group=1, scoring_func="sigmoid")


STANDARD_KEYS = {"dflash.rope.scaling.type": b"yarn", "dflash.rope.scaling.factor": 4.0,
                 "dflash.rope.scaling.original_context_length": 2048, "dflash.rope.scaling.yarn_beta_fast": 32.0,
                 "dflash.rope.scaling.yarn_beta_slow": 1.0, "dflash.rope.scaling.yarn_attn_factor": 1.25,
                 "dflash.rope.freq_base_swa": 10000.0, "dflash.expert_count": 8, "dflash.expert_used_count": 2,
                 "dflash.expert_group_count": 2, "dflash.expert_group_used_count": 1, "dflash.expert_gating_func": 2}


def test_optional_standard_keys_match_llama_cpp_and_come_back(tmp_path, target_path, llama_cpp_src):
    hf = build_hf_target(target_path, tmp_path / "hf-target")
    src = make_test_draft(target_path, tmp_path / "d.gguf", kind="dspark", n_layers=1, seed=4)
    ck = _released(src, tmp_path / "ck")
    _edit_config(ck, _standard_options)
    ref = _llama_convert(llama_cpp_src, ck, hf, tmp_path / "ref.gguf")
    mr, _ = _meta(ref)
    for k, v in STANDARD_KEYS.items():
        assert mr[k][0] == v, k
    assert abs(mr["dflash.attention.layer_norm_epsilon"][0] - 1e-6) < 1e-12
    # our convert writes what llama.cpp's converter writes (fc.weight: F32 either way at outtype f32)
    ours = convert_checkpoint(ck, target_path, tmp_path / "ours.gguf", outtype="f32")
    _assert_same(ref, ours, ignore=_GENERAL_DIFF)
    # the draft llama.cpp made exports, and both converters make it again
    ck2 = export_checkpoint(ref, tmp_path / "ck2")
    _assert_same(ref, _llama_convert(llama_cpp_src, ck2, hf, tmp_path / "again.gguf"), ignore={"general.name"})
    _assert_same(ref, convert_checkpoint(ck2, target_path, tmp_path / "rt.gguf"))


# ---------------------------------------------------------------- every key gguf-py names

def _vendored_arch_keys(src):
    """Every ``{arch}.*`` key of the vendored gguf-py (llama.cpp's own list), as ``dflash.*``."""
    spec = importlib.util.spec_from_file_location("vendored_gguf_constants",
                                                  os.path.join(src, "gguf-py", "gguf", "constants.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = set()
    for group in vars(mod.Keys).values():
        if inspect.isclass(group):
            for v in vars(group).values():
                if isinstance(v, str) and v.startswith("{arch}.") and "{" not in v[len("{arch}."):]:
                    out.add("dflash." + v[len("{arch}."):])
    return out


def _all_keys_draft(src_gguf, out, keys):
    """``src_gguf`` plus every key of ``keys`` it lacks: the ones export maps with values of their
    meaning, the rest an arbitrary UINT32 (export keeps those as they are)."""
    import gguf

    vt = gguf.GGUFValueType
    m, r = _meta(src_gguf)
    n_vocab = len(m["tokenizer.ggml.tokens"][0])
    typed = {"dflash.vocab_size": (n_vocab, vt.UINT32, None), "dflash.attention.causal": (True, vt.BOOL, None),
             "dflash.attention.sliding_window": (64, vt.UINT32, None),
             "dflash.attention.sliding_window_pattern": ([True, False], vt.ARRAY, vt.BOOL),
             "dflash.rope.dimension_sections": ([32, 0, 0, 0], vt.ARRAY, vt.INT32),
             "dflash.attention.layer_norm_epsilon": (1e-6, vt.FLOAT32, None),
             "dflash.rope.scaling.finetuned": (True, vt.BOOL, None),
             "dflash.attention.value_scale": (0.75, vt.FLOAT32, None),
             "dflash.rope.scaling.yarn_ext_factor": (1.0, vt.FLOAT32, None),
             "dflash.logit_scale": (0.5, vt.FLOAT32, None), "dflash.final_logit_softcapping": (30.0, vt.FLOAT32, None),
             "dflash.embedding_scale": (2.0, vt.FLOAT32, None)}
    for k, v in STANDARD_KEYS.items():
        typed[k] = (v, vt.STRING, None) if isinstance(v, bytes) else (
            (v, vt.FLOAT32, None) if isinstance(v, float) else (v, vt.UINT32, None))
    for k in sorted(keys - set(m)):
        m[k] = typed.get(k, (3, vt.UINT32, None))
    return write_gguf(out, "dflash", {k: v for k, v in m.items() if k != "general.architecture"},
                      {t.name: (np.array(t.data), t.tensor_type) for t in r.tensors})


def test_every_key_comes_back(tmp_path, target_path, llama_cpp_src):
    keys = _vendored_arch_keys(llama_cpp_src)
    assert {"dflash.vocab_size", "dflash.block_size", "dflash.target_layers", "dflash.expert_count"} <= keys
    base = make_test_draft(target_path, tmp_path / "d.gguf", kind="dspark", n_layers=2, seed=5)
    src = _all_keys_draft(base, tmp_path / "all.gguf", keys)
    ck = export_checkpoint(src, tmp_path / "ck")
    kept = set(json.load(open(os.path.join(ck, "config.json")))["pyllama_dspark"]["gguf_keys"])
    back = convert_checkpoint(ck, target_path, tmp_path / "rt.gguf")
    _assert_same(src, back)                       # every key, value and GGUF type
    assert keys <= set(_meta(back)[0])
    # llama.cpp's converter gives back exactly what export put into config fields
    hf = build_hf_target(target_path, tmp_path / "hf-target")
    ref = _llama_convert(llama_cpp_src, _released(src, tmp_path / "ck-released"), hf, tmp_path / "ref.gguf")
    ms, _ = _meta(src)
    mr, _ = _meta(ref)
    arch = {k for k in ms if k.startswith("dflash.")}
    assert {k for k in arch if k not in mr} == kept - {k for k in kept if k in mr and mr[k] == ms[k]}
    for k in arch - kept:
        assert mr[k] == ms[k], k
    assert kept >= {"dflash.vocab_size", "dflash.rope.scaling.finetuned"} and "dflash.expert_count" not in kept
