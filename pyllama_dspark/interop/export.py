"""``dflash`` draft GGUF -> Hugging Face checkpoint (``config.json`` + ``model.safetensors``).

The inverse of :mod:`pyllama_dspark.interop.convert` (and of llama.cpp's converter): the config is
the DFlash-lineage layout with a nested ``dflash_config`` that llama.cpp's ``convert_hf_to_gguf.py``
reads, tensors get their HF names (``layers.N.self_attn.q_proj.weight``, ``fc.weight``,
``hidden_norm.weight``, ``markov_head.markov_w1.weight``, ...), and

* ``dflash.target_layers`` (layer-input ids) become HF ``target_layer_ids`` (one lower);
* ``d2t`` (absolute target ids in the GGUF) becomes offsets (``target id - draft id``), and a
  ``t2d`` mask is added for runtimes that read it;
* a full-vocabulary draft has no ``lm_head`` (it shares the target's output head);
* F32 / F16 tensors keep their type, BF16 and quantized (Q8_0) tensors are written as F32.

Every ``dflash.*`` key is taken: the ones llama.cpp's converter writes from a config field go to
that field (docs/interop.md has the table), and the rest (``dflash.vocab_size``, which llama.cpp
writes from the target's tokenizer handler, and every key no config field holds) are kept as they
are in ``pyllama_dspark.gguf_keys``.  That section of ``config.json`` also records the GGUF type of
every tensor and the ``general.*`` keys, so ``convert`` (outtype ``auto``) restores the draft bit for
bit (a Q8_0 tensor dequantized to F32 quantizes back to the same blocks).  Tokenizer keys are not exported: the
checkpoint uses its target's tokenizer, and ``convert`` copies it from the target GGUF.  Nor are
``convert``'s provenance keys (``pyllama_dspark.source.*``): a new conversion writes its own.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import OrderedDict
from typing import Any, Dict

import numpy as np

from pyllama_dspark.gguf.info import DRAFT_ARCH
from pyllama_dspark.gguf.reader import field_value, read_gguf
from pyllama_dspark.gguf.write import raw_field
from pyllama_dspark.interop.checkpoint import CheckpointError
from pyllama_dspark.interop.convert import _GLOBAL, _LAYER, PROVENANCE_KEY

__all__ = ["export_checkpoint"]

_HF_GLOBAL = {g: h for h, g in _GLOBAL.items()}
_HF_LAYER = {g: h for h, g in _LAYER.items()}

#: llama.cpp's ``expert_gating_func`` values (gguf-py ExpertGatingFuncType) -> the config's ``scoring_func``
_GATING = {1: "softmax", 2: "sigmoid", 3: "sqrtsoftplus"}
#: rope.scaling.yarn_* -> the rope_scaling field llama.cpp's converter reads it from
_YARN = (("yarn_ext_factor", "extrapolation_factor"), ("yarn_attn_factor", "attention_factor"),
         ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"))
#: expert keys -> the config fields llama.cpp's converter reads them from (TextModel.set_gguf_parameters)
_EXPERTS = (("expert_count", "num_experts"), ("expert_used_count", "num_experts_per_tok"),
            ("expert_group_count", "n_group"), ("expert_group_used_count", "topk_group"))


def hf_tensor_name(name: str) -> str:
    if name in _HF_GLOBAL:
        return _HF_GLOBAL[name]
    parts = name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _HF_LAYER:
        return f"layers.{parts[1]}.{_HF_LAYER[parts[2]]}"
    raise CheckpointError(f"draft tensor {name!r} has no Hugging Face name (not a DSpark/DFlash tensor)")


def _array(t) -> np.ndarray:
    import gguf

    q = gguf.GGMLQuantizationType
    if t.tensor_type in (q.F32, q.F16, q.I64, q.I32):
        return np.array(t.data)
    return np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)


class _Keys:
    """The draft's ``dflash.*`` keys, each marked once :meth:`get` reads it into the config."""

    def __init__(self, r):
        self.r, self.used = r, set()

    def get(self, k, d=None):
        v = field_value(self.r, f"{DRAFT_ARCH}.{k}", None)
        if v is None:
            return d
        self.used.add(f"{DRAFT_ARCH}.{k}")
        return v

    def has(self, k) -> bool:
        return f"{DRAFT_ARCH}.{k}" in self.r.fields

    def kept(self) -> Dict[str, list]:
        """The keys no config field took, as ``[value, GGUF type, array item type]`` (strings as
        text): ``convert`` writes them back as they were; llama.cpp's converter has no config field
        for them (docs/interop.md)."""
        out = {}
        for k in self.r.fields:
            if k.startswith(f"{DRAFT_ARCH}.") and k not in self.used:
                value, vt, sub = raw_field(self.r, k)
                try:
                    value = ([x.decode("utf-8") for x in value] if sub is not None and sub.name == "STRING"
                             else value.decode("utf-8") if isinstance(value, bytes) else value)
                except UnicodeDecodeError:
                    raise CheckpointError(f"draft metadata key {k!r} holds a string that is not UTF-8")
                out[k] = [value, vt.name, None if sub is None else sub.name]
        return out


def _standard_config(keys: _Keys, cfg: Dict[str, Any]) -> None:
    """The standard keys llama.cpp's converter writes from these config fields (TextModel
    .set_gguf_parameters): layer-norm epsilon, the sliding-window RoPE base, RoPE scaling, experts."""
    if keys.has("attention.layer_norm_epsilon"):
        cfg["layer_norm_eps"] = float(keys.get("attention.layer_norm_epsilon"))
    if keys.has("rope.freq_base_swa"):
        cfg["rope_local_base_freq"] = float(keys.get("rope.freq_base_swa"))
    kind = field_value(keys.r, f"{DRAFT_ARCH}.rope.scaling.type", None)
    # the converter writes linear / yarn with their factor (yarn with its original context), longrope alone
    if kind == "longrope" or (kind in ("linear", "yarn") and keys.has("rope.scaling.factor") and (
            kind == "linear" or keys.has("rope.scaling.original_context_length"))):
        rs: Dict[str, Any] = {"rope_type": keys.get("rope.scaling.type")}
        if kind != "longrope":
            rs["factor"] = float(keys.get("rope.scaling.factor"))
        if kind == "yarn":
            rs["original_max_position_embeddings"] = int(keys.get("rope.scaling.original_context_length"))
            for gkey, hkey in _YARN:
                if keys.has(f"rope.scaling.{gkey}"):
                    rs[hkey] = float(keys.get(f"rope.scaling.{gkey}"))
        cfg["rope_scaling"] = rs
    for gkey, hkey in _EXPERTS:
        if keys.has(gkey):
            cfg[hkey] = int(keys.get(gkey))
    gating = field_value(keys.r, f"{DRAFT_ARCH}.expert_gating_func", None)
    if gating is not None and int(gating) in _GATING:
        cfg["scoring_func"] = _GATING[int(keys.get("expert_gating_func"))]


def _config(r, tensors: Dict[str, Any]) -> Dict[str, Any]:
    a = DRAFT_ARCH
    keys = _Keys(r)
    get = keys.get
    dspark = "markov_w1.weight" in tensors
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in r.fields else None
    if n_vocab is None:
        raise CheckpointError("draft GGUF has no tokenizer.ggml.tokens (its vocabulary size is unknown)")
    if keys.has("vocab_size") and int(field_value(r, f"{a}.vocab_size")) != n_vocab:
        raise CheckpointError(f"draft metadata {a}.vocab_size {field_value(r, f'{a}.vocab_size')} != the "
                              f"{n_vocab} tokens of tokenizer.ggml.tokens")
    n_head = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // n_head))
    if int(field_value(r, f"{a}.attention.value_length", head_dim)) == head_dim:
        get("attention.value_length")       # convert writes it as key_length; another value is kept as is
    layers = [int(x) for x in get("target_layers", [])]
    if not layers:
        raise CheckpointError(f"draft GGUF lacks {a}.target_layers")
    dfc: Dict[str, Any] = {"block_size": int(get("block_size", 16)), "target_layer_ids": [i - 1 for i in layers]}
    mask = field_value(r, "tokenizer.ggml.mask_token_id", None)
    if mask is not None:
        dfc["mask_token_id"] = int(mask)
    if get("attention.causal") is not None:
        dfc["causal"] = bool(get("attention.causal"))
    if keys.has("conv_kernel_size"):
        for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if get(k) is not None:
                dfc[k] = int(get(k))
    if get("attention.value_scale") is not None:
        dfc["attention_value_scale"] = float(get("attention.value_scale"))
    cfg: Dict[str, Any] = {
        "architectures": ["DSparkDraftModel" if dspark else
                          "DFlash2DraftModel" if "conv_kernel_size" in dfc else "DFlashDraftModel"],
        "model_type": "qwen3", "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "hidden_size": hidden, "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")), "num_attention_heads": n_head,
        "num_key_value_heads": int(get("attention.head_count_kv", n_head)), "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")), "rope_theta": float(get("rope.freq_base")),
        "max_position_embeddings": int(get("context_length")), "vocab_size": int(n_vocab),
        "block_size": dfc["block_size"], "dflash_config": dfc,
    }
    if get("rope.dimension_count") is not None:
        cfg["partial_rotary_factor"] = int(get("rope.dimension_count")) / head_dim
    for key, gkey in (("output_multiplier", "logit_scale"), ("final_logit_softcapping", "final_logit_softcapping"),
                      ("input_embedding_scale", "embedding_scale")):
        if get(gkey) is not None:
            cfg[key] = float(get(gkey))
    if get("attention.sliding_window") is not None:
        pattern = list(get("attention.sliding_window_pattern", []) or [])
        cfg.update(use_sliding_window=True, sliding_window=int(get("attention.sliding_window")),
                   layer_types=["sliding_attention" if p else "full_attention" for p in pattern])
    _standard_config(keys, cfg)
    if dspark:
        cfg["markov_head_type"] = "vanilla"
        cfg["markov_rank"] = int(tensors["markov_w1.weight"].shape[-1])
        cfg["sample_from_anchor"] = bool(get("sample_from_anchor", True))
        if "d2t" in tensors:
            cfg["draft_vocab_size"] = int(tensors["d2t"].size)
        get("has_confidence_head")          # both converters set it from the conf_proj tensors
    cfg[PROVENANCE_KEY] = {"gguf_keys": keys.kept()}
    return cfg


def export_checkpoint(draft_path, out_dir) -> str:
    """Write ``config.json`` + ``model.safetensors`` for the draft GGUF into ``out_dir``; returns it.

    The directory is filled through a temporary sibling and renamed, so it is never half-written
    (an existing ``out_dir`` must be empty).
    """
    from safetensors.numpy import save_file

    r = read_gguf(draft_path, use_cache=False)
    if field_value(r, "general.architecture", None) != DRAFT_ARCH:
        raise CheckpointError(f"{os.path.basename(os.fspath(draft_path))} is not a {DRAFT_ARCH} draft GGUF "
                              f"(general.architecture {field_value(r, 'general.architecture', None)!r})")
    arrays: "OrderedDict[str, np.ndarray]" = OrderedDict()
    types: Dict[str, str] = {}
    for t in r.tensors:
        arrays[t.name] = _array(t)
        types[t.name] = t.tensor_type.name
    cfg = _config(r, arrays)
    general = {k: field_value(r, k) for k in r.fields if k.startswith("general.") and k != "general.architecture"}
    cfg[PROVENANCE_KEY].update(general_name=field_value(r, "general.name", None), general=general, gguf_types=types,
                               source=os.path.basename(os.fspath(draft_path)))
    if "d2t" in arrays and "output.weight" not in arrays:
        raise CheckpointError("draft has d2t but no output.weight (a reduced vocabulary needs its own lm_head)")
    if "output.weight" in arrays and "d2t" not in arrays and "markov_w1.weight" in arrays:
        raise CheckpointError("draft has its own output.weight but no d2t: a full-vocabulary DSpark draft shares the "
                              "target's output head, and llama.cpp's converter would drop it")
    out: Dict[str, np.ndarray] = {}
    for name, arr in arrays.items():
        if name == "d2t":
            ids = arr.astype(np.int64).reshape(-1)
            out["d2t"] = ids - np.arange(ids.size, dtype=np.int64)
            t2d = np.zeros(cfg["vocab_size"], dtype=np.bool_)
            t2d[ids] = True
            out["t2d"] = t2d
            continue
        arr = arr if arr.dtype in (np.float32, np.float16) else arr.astype(np.float32)
        out[hf_tensor_name(name)] = np.ascontiguousarray(arr)
    cfg["torch_dtype"] = "float16" if any(v.dtype == np.float16 for v in out.values()) else "float32"

    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise CheckpointError(f"output directory {out_dir!r} exists and is not empty")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        save_file(out, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as fh:
            json.dump(cfg, fh, indent=2)
            fh.write("\n")
        for f in os.listdir(tmp):
            os.chmod(os.path.join(tmp, f), 0o644)
        os.chmod(tmp, 0o755)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
