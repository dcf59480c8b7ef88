"""Hugging Face DSpark/DFlash drafter checkpoint -> the ``dflash`` draft GGUF llama.cpp loads.

The output has the tensor names, metadata keys and value types llama.cpp's converter
(``convert_hf_to_gguf.py``, ``conversion/qwen.py``: ``DFlashModel`` / ``DSparkModel``) writes, but
takes what that converter reads from the target's HF directory from the target GGUF instead:
every ``tokenizer.*`` key (vocabulary, merges, special ids, chat template), whether the target
uses M-RoPE sections, and, for a ``mask_embedding.pt`` draft, the target's token embeddings and
output head (dequantized to F32).  Tensor types follow the converter's rules (1-D tensors, ``*_norm.weight``
and non-``.weight`` tensors F32, the rest in the outtype; Q8_0 falls back to F16 when a row is not
a multiple of 32) with one deviation: ``fc.weight`` stays F32, because F16 overflows on the
target's layer inputs on CPU.  ``outtype="auto"`` keeps each tensor's checkpoint type (BF16 stays
BF16), or the GGUF type :mod:`pyllama_dspark.interop.export` recorded, so an exported draft comes
back bit for bit.  Everything is validated before the (atomic) write.

Provenance: the draft records where it came from in two keys of its own, which llama.cpp ignores
and ``pyllama-dspark inspect`` prints: ``pyllama_dspark.source.config`` (the checkpoint's
``config.json`` text, as it was) and ``pyllama_dspark.source.outtype``.  ``export`` does not carry
them into the checkpoint (they describe a conversion, not the weights), so export -> convert gives
back every tensor and every other key bit for bit, and fresh provenance keys.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from typing import Any, Dict, Optional, Tuple

import numpy as np

from pyllama_dspark.gguf.info import DRAFT_ARCH, SOURCE_PREFIX
from pyllama_dspark.gguf.reader import field_value, read_gguf
from pyllama_dspark.gguf.target_info import read_target_info
from pyllama_dspark.gguf.write import infer_type, raw_field, write_gguf
from pyllama_dspark.interop.checkpoint import (CheckpointError, expected_shapes, normalize_config, optional_shapes,
                                               read_checkpoint, strip_model_prefix)

__all__ = ["convert_checkpoint", "OUTTYPES", "gguf_tensor_name", "PROVENANCE_KEY", "SOURCE_PREFIX",
           "SOURCE_CONFIG_KEY", "SOURCE_OUTTYPE_KEY"]

OUTTYPES = ("auto", "f32", "f16", "bf16", "q8_0")
#: config.json section :mod:`~pyllama_dspark.interop.export` writes (GGUF types, general.name)
PROVENANCE_KEY = "pyllama_dspark"
#: GGUF keys convert writes: where the draft came from (not exported; see the module docstring)
SOURCE_CONFIG_KEY = SOURCE_PREFIX + "config"
SOURCE_OUTTYPE_KEY = SOURCE_PREFIX + "outtype"

_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight", "self_attn.sinks": "attn_sinks.weight",
          # DFlash2: per-layer dynamic convolutions
          "attention_conv.base_kernel": "attn_conv_base", "attention_conv.kernel_projection.weight":
          "attn_conv_proj.weight", "mlp_conv.base_kernel": "ffn_conv_base",
          "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight"}
_GLOBAL = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
           "norm.weight": "output_norm.weight", "embed_tokens.weight": "token_embd.weight",
           "lm_head.weight": "output.weight", "markov_head.markov_w1.weight": "markov_w1.weight",
           "markov_head.markov_w2.weight": "markov_w2.weight", "confidence_head.proj.weight": "conf_proj.weight",
           "confidence_head.proj.bias": "conf_proj.bias", "d2t": "d2t",
           # DFlash2: the candidate selector
           "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
           "candidate_selector.successor_codebook": "selector_successor.weight",
           "candidate_selector.hidden_projection.weight": "selector_hidden.weight"}
_ORDER_GLOBAL_HEAD = ("token_embd.weight", "fc.weight", "enc.output_norm.weight")
_ORDER_GLOBAL_TAIL = ("output_norm.weight", "markov_w1.weight", "markov_w2.weight", "conf_proj.weight",
                      "conf_proj.bias", "selector_predecessor.weight", "selector_successor.weight",
                      "selector_hidden.weight", "output.weight", "d2t")
_LAYER_ORDER = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                "attn_q_norm.weight", "attn_k_norm.weight", "attn_sinks.weight", "ffn_norm.weight",
                "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "attn_conv_base", "attn_conv_proj.weight",
                "ffn_conv_base", "ffn_conv_proj.weight")
_ROPE_PERMUTE = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight")


def gguf_tensor_name(hf: str) -> Optional[str]:
    """GGUF name of a checkpoint tensor (``model.`` prefix optional); None when unknown."""
    hf = hf[len("model."):] if hf.startswith("model.") else hf
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", hf)
    if m and m.group(2) in _LAYER:
        return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}"
    return None


def _order_key(name: str) -> Tuple[int, int, int]:
    if name in _ORDER_GLOBAL_HEAD:
        return (0, _ORDER_GLOBAL_HEAD.index(name), 0)
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m:
        return (1, int(m.group(1)), _LAYER_ORDER.index(m.group(2)))
    return (2, _ORDER_GLOBAL_TAIL.index(name), 0)


def _encode(arr: np.ndarray, gtype: str):
    """(data, raw_dtype) for gguf; Q8_0 falls back to F16 on rows that are not 32-aligned."""
    import gguf

    q = gguf.GGMLQuantizationType
    if gtype == "I64":
        return np.ascontiguousarray(arr, dtype=np.int64), None
    if gtype == "F32":
        return np.ascontiguousarray(arr, dtype=np.float32), None
    if gtype == "F16":
        return np.ascontiguousarray(arr, dtype=np.float16), None
    a32 = np.ascontiguousarray(arr, dtype=np.float32)
    if gtype == "BF16":
        return gguf.quants.quantize(a32, q.BF16), q.BF16
    if gtype == "Q8_0":
        if a32.shape[-1] % 32:
            return np.ascontiguousarray(arr, dtype=np.float16), None
        return gguf.quants.quantize(a32, q.Q8_0), q.Q8_0
    raise CheckpointError(f"unsupported GGUF type {gtype!r}")


def _gguf_type(name: str, arr: np.ndarray, src_dtype: str, outtype: str, recorded: Dict[str, str]) -> str:
    if name == "d2t":
        return "I64"
    if outtype == "auto" and name in recorded:
        return recorded[name]
    if arr.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return "F32"
    if name == "fc.weight":
        return "F32"          # deviation from llama.cpp: F16 overflows on the target's layer inputs
    if outtype == "auto":
        return {"F16": "F16", "BF16": "BF16"}.get(src_dtype, "F32")
    return outtype.upper()


def _file_type(outtype: str, tensors) -> int:
    """``general.file_type`` (llama_ftype) as llama.cpp's converter sets it; for ``auto`` its guess
    (the first matrix in BF16 / F16), else all-F32 (our ``auto`` keeps F32 matrices F32)."""
    import gguf

    ft = gguf.LlamaFileType
    if outtype == "auto":
        for _, (arr, dt) in tensors.items():
            if arr.ndim >= 2 and dt in ("BF16", "F16"):
                return int(ft.MOSTLY_BF16 if dt == "BF16" else ft.MOSTLY_F16)
        return int(ft.ALL_F32)
    return int({"f32": ft.ALL_F32, "f16": ft.MOSTLY_F16, "bf16": ft.MOSTLY_BF16, "q8_0": ft.MOSTLY_Q8_0}[outtype])


def _check_layers(cfg: Dict[str, Any], tinfo, tname: str) -> list:
    stored = [i + 1 for i in cfg["target_layer_ids"]]
    for tid, lid in zip(cfg["target_layer_ids"], stored):
        if lid < 0 or lid > tinfo.max_layer_id:
            raise CheckpointError(
                f"config.json target_layer_ids {cfg['target_layer_ids']}: id {tid} (stored as layer input "
                f"{lid}) is beyond target {tname} ({tinfo.arch}, {tinfo.n_layer} layers; valid HF ids "
                f"-1..{tinfo.max_layer_id - 1})")
    if len(set(stored)) != len(stored):
        raise CheckpointError(f"config.json target_layer_ids {cfg['target_layer_ids']} repeats an id")
    return stored


def _load_tensors(ck, cfg) -> "OrderedDict[str, Tuple[np.ndarray, str]]":
    """Validated tensors: GGUF name -> (array in HF layout, checkpoint dtype)."""
    names = strip_model_prefix(list(ck.files))
    by_short: Dict[str, str] = {}
    for full, short in names.items():
        if short in by_short:
            raise CheckpointError(f"tensor {short!r} is stored twice ({by_short[short]!r} and {full!r})")
        by_short[short] = full
    by_short.pop("t2d", None)   # not used at run time (llama.cpp's converter drops it too)
    rank = cfg["hp"].get("markov_rank")
    if rank is None and "markov_head.markov_w1.weight" in by_short:
        rank = ck.shapes[by_short["markov_head.markov_w1.weight"]][-1]
    req, opt = expected_shapes(cfg, rank), optional_shapes(cfg, rank)
    for short in req:
        if short not in by_short:
            raise CheckpointError(f"checkpoint lacks tensor {short!r}")
    for short, full in by_short.items():
        if short not in req and short not in opt:
            raise CheckpointError(f"checkpoint has an unexpected tensor {full!r} (not part of a "
                                  f"{cfg['arch']} drafter with this config)")
        want = req.get(short, opt.get(short))
        if want is not None and tuple(ck.shapes[full]) != tuple(want):
            raise CheckpointError(f"tensor {full!r} has shape {list(ck.shapes[full])}, expected {list(want)} "
                                  f"(from config.json)")
    out: "OrderedDict[str, Tuple[np.ndarray, str]]" = OrderedDict()
    full_vocab = cfg["draft_vocab_size"] == cfg["vocab_size"]
    for short, full in by_short.items():
        if short == "lm_head.weight" and full_vocab and cfg["kind"] == "dspark":
            continue                          # a full-vocabulary DSpark draft shares the target's output head
        arr = ck.tensor(full)
        if not cfg["hp"].get("rope_is_neox_style", True) and short.endswith(_ROPE_PERMUTE):
            hd = cfg["head_dim"]          # interleaved RoPE -> NeoX: per head, even dims first, then odd
            arr = arr.reshape(-1, hd // 2, 2, *arr.shape[1:]).swapaxes(1, 2).reshape(arr.shape)
        out[gguf_tensor_name(short)] = (arr, ck.dtypes[full])
    if "d2t" in out:
        out["d2t"] = (_d2t_absolute(out["d2t"][0], cfg), "I64")
    return OrderedDict(sorted(out.items(), key=lambda kv: _order_key(kv[0])))


def _target_tensor(treader, names, tname: str) -> np.ndarray:
    import gguf

    by_name = {t.name: t for t in treader.tensors}
    for n in names:
        if n in by_name:
            t = by_name[n]
            return np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)
    raise CheckpointError(f"target {tname} has no {' / '.join(names)} tensor (needed by mask_embedding.pt)")


def _add_mask_embedding(tensors, path: str, cfg, treader, tname: str) -> None:
    """MiMo-style drafts: the target's token embeddings with the mask row replaced by the draft's own
    vector (``token_embd.weight``), and, for DFlash, the target's output head (``output.weight``) --
    taken from the target GGUF (dequantized to F32) where llama.cpp's converter reads the HF target."""
    try:
        import torch
    except ImportError:
        raise CheckpointError("mask_embedding.pt needs torch to be read (pip install torch)") from None
    try:
        mask = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:   # noqa: BLE001 -- pickle / zip errors of a corrupt file
        raise CheckpointError(f"mask_embedding.pt cannot be read: {exc}") from exc
    if not isinstance(mask, dict) or "embedding" not in mask or "mask_token_id" not in mask:
        raise CheckpointError("mask_embedding.pt must hold a dict with 'mask_token_id' and 'embedding'")
    mid = int(mask["mask_token_id"])
    if cfg["mask_token_id"] is None or mid != cfg["mask_token_id"]:
        raise CheckpointError(f"mask_embedding.pt mask_token_id {mid} does not match config.json mask_token_id "
                              f"{cfg['mask_token_id']}")
    vec = mask["embedding"].float().numpy()
    if vec.shape != (cfg["hidden_size"],):
        raise CheckpointError(f"mask_embedding.pt embedding has shape {list(vec.shape)}, expected "
                              f"[{cfg['hidden_size']}]")
    if "token_embd.weight" in tensors:
        table, dtype = tensors["token_embd.weight"]
        table = table.copy()
    else:
        table, dtype = _target_tensor(treader, ("token_embd.weight",), tname), "F32"
    if table.shape != (cfg["vocab_size"], cfg["hidden_size"]):
        raise CheckpointError(f"target token embeddings have shape {list(table.shape)}, expected "
                              f"[{cfg['vocab_size']}, {cfg['hidden_size']}]")
    table[mid] = vec.astype(table.dtype)
    tensors["token_embd.weight"] = (table, dtype)
    if "output.weight" not in tensors and not (cfg["kind"] == "dspark"
                                               and cfg["draft_vocab_size"] == cfg["vocab_size"]):
        tensors["output.weight"] = (_target_tensor(treader, ("output.weight", "token_embd.weight"), tname), "F32")


def _d2t_absolute(d2t: np.ndarray, cfg) -> np.ndarray:
    if d2t.dtype.kind not in "iu":
        raise CheckpointError(f"tensor 'd2t' must hold integers, got {d2t.dtype}")
    ids = d2t.astype(np.int64).reshape(-1) + np.arange(d2t.size, dtype=np.int64)
    bad = np.nonzero((ids < 0) | (ids >= cfg["vocab_size"]))[0]
    if bad.size:
        raise CheckpointError(f"tensor 'd2t': draft token {int(bad[0])} maps to target id {int(ids[bad[0]])}, "
                              f"outside the vocabulary of {cfg['vocab_size']}")
    if np.unique(ids).size != ids.size:
        raise CheckpointError("tensor 'd2t' maps two draft tokens to the same target token")
    return ids


#: the config fields llama.cpp's converter (TextModel.set_gguf_parameters) writes the standard keys from
_EXPERT_FIELDS = (("expert_count", ("num_local_experts", "num_experts", "n_routed_experts")),
                  ("expert_used_count", ("num_experts_per_tok", "num_experts_per_token", "top_k_experts")),
                  ("expert_group_count", ("n_group",)), ("expert_group_used_count", ("topk_group",)))
_GATING_FIELDS = ("score_function", "scoring_func", "score_func", "moe_router_activation",
                  "moe_router_activation_func", "expert_selection_fn")
_GATING = {"softmax": 1, "sigmoid": 2, "sqrtsoftplus": 3}
_LOCAL_THETA = ("local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta", "rope_local_base_freq")


def _first(hp: Dict[str, Any], names):
    return next((hp[n] for n in names if hp.get(n) is not None), None)


def _standard_metadata(cfg) -> "OrderedDict[str, Tuple[Any, Any, Any]]":
    """RoPE scaling, the sliding-window RoPE base, the layer-norm epsilon and the expert counts, as
    llama.cpp's converter writes them from the config (TextModel.set_gguf_parameters)."""
    import gguf

    vt, a, hp = gguf.GGUFValueType, DRAFT_ARCH, cfg["hp"]
    out: "OrderedDict[str, Tuple[Any, Any, Any]]" = OrderedDict()
    rp = cfg["rope_params"]
    rp = rp.get("full_attention", rp)
    kind, factor = rp.get("rope_type", rp.get("type")), rp.get("factor")
    if kind in ("linear", "yarn") and factor is not None:
        out[f"{a}.rope.scaling.type"] = (kind, vt.STRING, None)
        out[f"{a}.rope.scaling.factor"] = (float(factor), vt.FLOAT32, None)
        if kind == "yarn":
            orig = rp.get("original_max_position_embeddings", hp.get("original_max_position_embeddings"))
            if orig is None:
                raise CheckpointError("config.json: yarn rope scaling without original_max_position_embeddings")
            out[f"{a}.rope.scaling.original_context_length"] = (int(orig), vt.UINT32, None)
            for gkey, names in (("yarn_ext_factor", ("extrapolation_factor",)),
                                ("yarn_attn_factor", ("attention_factor", "attn_factor")),
                                ("yarn_beta_fast", ("beta_fast",)), ("yarn_beta_slow", ("beta_slow",))):
                if (v := _first(rp, names)) is not None:
                    out[f"{a}.rope.scaling.{gkey}"] = (float(v), vt.FLOAT32, None)
    elif kind == "longrope":
        out[f"{a}.rope.scaling.type"] = (kind, vt.STRING, None)
    rp = cfg["rope_params"]      # a config-wide local base counts only where rope_parameters is not per layer type
    per_type = "full_attention" in rp or "sliding_attention" in rp
    swa = rp.get("sliding_attention", {}).get("rope_theta") if per_type else _first(hp, _LOCAL_THETA)
    if swa is not None:
        out[f"{a}.rope.freq_base_swa"] = (float(swa), vt.FLOAT32, None)
    if (eps := _first(hp, ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"))) is not None:
        out[f"{a}.attention.layer_norm_epsilon"] = (float(eps), vt.FLOAT32, None)
    for gkey, names in _EXPERT_FIELDS:
        if (v := _first(hp, names)) is not None:
            out[f"{a}.{gkey}"] = (int(v), vt.UINT32, None)
    if (fn := _first(hp, _GATING_FIELDS)) is not None:
        if fn not in _GATING:
            raise CheckpointError(f"config.json: unsupported expert gating function {fn!r}")
        out[f"{a}.expert_gating_func"] = (_GATING[fn], vt.UINT32, None)
    return out


def _kept_keys(prov: Dict[str, Any]) -> "OrderedDict[str, Tuple[Any, Any, Any]]":
    """The draft keys ``export`` kept in config.json's ``pyllama_dspark.gguf_keys`` (no config field
    holds them), with their GGUF types."""
    import gguf

    out: "OrderedDict[str, Tuple[Any, Any, Any]]" = OrderedDict()
    kept = prov.get("gguf_keys") or {}
    if not isinstance(kept, dict):
        raise CheckpointError("config.json: pyllama_dspark.gguf_keys must be an object {key: [value, type, item type]}")
    for key, entry in kept.items():
        try:
            value, vtype, sub = entry
            vtype = gguf.GGUFValueType[vtype]
            sub = None if sub is None else gguf.GGUFValueType[sub]
        except (TypeError, ValueError, KeyError):
            raise CheckpointError(f"config.json: pyllama_dspark.gguf_keys[{key!r}] is not [value, GGUF type, item type]")
        if not str(key).startswith(f"{DRAFT_ARCH}.") or (vtype == gguf.GGUFValueType.ARRAY) != (sub is not None):
            raise CheckpointError(f"config.json: pyllama_dspark.gguf_keys[{key!r}] is not a {DRAFT_ARCH} key "
                                  "with a GGUF type")
        out[str(key)] = (value, vtype, sub)
    return out


def _metadata(cfg, tinfo, treader, stored_layers, has_conf: bool, name: str, prov: Dict[str, Any],
              file_type: int):
    import gguf

    vt, a, hp, dfc = gguf.GGUFValueType, DRAFT_ARCH, cfg["hp"], cfg["dflash"]
    u32 = lambda v: (int(v), vt.UINT32, None)      # noqa: E731
    f32 = lambda v: (float(v), vt.FLOAT32, None)   # noqa: E731
    meta: "OrderedDict[str, Tuple[Any, Any, Any]]" = OrderedDict()
    general = dict(prov.get("general") or {})
    if general:                         # an exported draft: its general.* keys as they were
        for key, value in general.items():
            meta[key] = infer_type(key, value)
    else:
        meta["general.type"] = ("model", vt.STRING, None)
        meta["general.name"] = (name, vt.STRING, None)
        meta["general.file_type"] = u32(file_type)
        meta["general.quantization_version"] = u32(gguf.GGML_QUANT_VERSION)
    meta[f"{a}.context_length"] = u32(cfg["n_ctx"])
    meta[f"{a}.embedding_length"] = u32(cfg["hidden_size"])
    meta[f"{a}.block_count"] = u32(cfg["n_layers"])
    meta[f"{a}.feed_forward_length"] = u32(cfg["intermediate_size"])
    meta[f"{a}.attention.head_count"] = u32(cfg["n_head"])
    meta[f"{a}.attention.head_count_kv"] = u32(cfg["n_head_kv"])
    meta[f"{a}.attention.key_length"] = u32(cfg["head_dim"])
    meta[f"{a}.attention.value_length"] = u32(cfg["head_dim"])
    meta[f"{a}.attention.layer_norm_rms_epsilon"] = f32(cfg["rms_eps"])
    meta[f"{a}.rope.freq_base"] = f32(cfg["rope_theta"])
    meta.update(_standard_metadata(cfg))
    prf = cfg["rope_params"].get("partial_rotary_factor", hp.get("partial_rotary_factor"))
    if prf is not None:
        meta[f"{a}.rope.dimension_count"] = u32(int(cfg["head_dim"] * float(prf)))
    if dfc.get("attention_value_scale") is not None:
        meta[f"{a}.attention.value_scale"] = f32(dfc["attention_value_scale"])
    meta[f"{a}.block_size"] = u32(cfg["block_size"])
    if "conv_kernel_size" in dfc:
        for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            meta[f"{a}.{k}"] = u32(dfc[k])
    for key, gkey in (("output_multiplier", "logit_scale"), ("final_logit_softcapping", "final_logit_softcapping"),
                      ("input_embedding_scale", "embedding_scale")):
        v = dfc.get(key, hp.get(key))
        if v is not None and (gkey != "final_logit_softcapping" or float(v) > 0):
            meta[f"{a}.{gkey}"] = f32(v)
    meta[f"{a}.target_layers"] = (stored_layers, vt.ARRAY, vt.INT32)
    window = dfc.get("swa_window_size") or hp.get("sliding_window")
    if (hp.get("use_sliding_window", False) or dfc.get("use_swa", False)) and window:
        pattern = ([True] * cfg["n_layers"] if dfc.get("use_swa", False)
                   else [t == "sliding_attention" for t in hp.get("layer_types") or []])
        meta[f"{a}.attention.sliding_window"] = u32(window)
        meta[f"{a}.attention.sliding_window_pattern"] = (pattern, vt.ARRAY, vt.BOOL)
    causal = hp.get("is_causal", dfc.get("causal"))
    if causal is not None:
        meta[f"{a}.attention.causal"] = (bool(causal), vt.BOOL, None)
    if field_value(treader, f"{tinfo.arch}.rope.dimension_sections", None) is not None:
        meta[f"{a}.rope.dimension_sections"] = ([cfg["head_dim"] // 2, 0, 0, 0], vt.ARRAY, vt.INT32)
    if cfg["kind"] == "dspark":
        meta[f"{a}.sample_from_anchor"] = (bool(cfg["sample_from_anchor"]), vt.BOOL, None)
        meta[f"{a}.has_confidence_head"] = (has_conf, vt.BOOL, None)
    meta.update(_kept_keys(prov))
    for key in treader.fields:
        if key.startswith("tokenizer."):
            meta[key] = raw_field(treader, key)
    if cfg["mask_token_id"] is not None:
        meta["tokenizer.ggml.mask_token_id"] = u32(cfg["mask_token_id"])
    elif "tokenizer.ggml.mask_token_id" not in meta:
        raise CheckpointError("config.json has no mask_token_id (dflash_config.mask_token_id) and the target "
                              "has none: llama.cpp cannot run the draft without a mask token")
    return meta


def convert_checkpoint(checkpoint_dir, target_path, out_path, outtype: str = "auto") -> str:
    """Convert the drafter checkpoint in ``checkpoint_dir`` for the target GGUF; returns ``out_path``.

    Raises :class:`CheckpointError` (naming the file, key or tensor) before anything is written.
    """
    outtype = str(outtype).lower()
    if outtype not in OUTTYPES:
        raise CheckpointError(f"outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    ck = read_checkpoint(checkpoint_dir)
    cfg = normalize_config(ck.config)
    tinfo = read_target_info(target_path, require_layer_inputs=False)
    treader = read_gguf(target_path)
    tname = os.path.basename(os.fspath(target_path))
    if cfg["hidden_size"] != tinfo.n_embd:
        raise CheckpointError(f"config.json hidden_size {cfg['hidden_size']} != target {tname} "
                              f"embedding_length {tinfo.n_embd}: the draft was made for another target")
    if cfg["vocab_size"] != tinfo.n_vocab:
        raise CheckpointError(f"config.json vocab_size {cfg['vocab_size']} != target {tname} vocabulary size "
                              f"{tinfo.n_vocab}: the draft was made for another target")
    if cfg["mask_token_id"] is not None and not 0 <= cfg["mask_token_id"] < cfg["vocab_size"]:
        raise CheckpointError(f"config.json mask_token_id {cfg['mask_token_id']} is outside the vocabulary")
    if cfg["block_size"] < 1:
        raise CheckpointError(f"config.json block_size {cfg['block_size']} must be >= 1")
    stored_layers = _check_layers(cfg, tinfo, tname)
    tensors = _load_tensors(ck, cfg)
    if os.path.isfile(os.path.join(ck.path, "mask_embedding.pt")):
        _add_mask_embedding(tensors, os.path.join(ck.path, "mask_embedding.pt"), cfg, treader, tname)
        tensors = OrderedDict(sorted(tensors.items(), key=lambda kv: _order_key(kv[0])))
    prov = ck.config.get(PROVENANCE_KEY) or {}
    recorded = dict(prov.get("gguf_types") or {})
    name = prov.get("general_name") or ck.config.get("_name_or_path") or os.path.basename(
        os.path.abspath(ck.path))
    types = OrderedDict((n, _gguf_type(n, arr, dt, outtype, recorded)) for n, (arr, dt) in tensors.items())
    meta = _metadata(cfg, tinfo, treader, stored_layers, "conf_proj.weight" in tensors, str(name), prov,
                     _file_type(outtype, tensors))
    with open(os.path.join(ck.path, "config.json"), encoding="utf-8") as fh:
        meta[SOURCE_CONFIG_KEY] = infer_type(SOURCE_CONFIG_KEY, fh.read())
    meta[SOURCE_OUTTYPE_KEY] = infer_type(SOURCE_OUTTYPE_KEY, outtype)
    encoded = OrderedDict((n, _encode(arr, types[n])) for n, (arr, _) in tensors.items())
    return write_gguf(out_path, DRAFT_ARCH, meta, encoded, tmp_prefix=".convert-")
