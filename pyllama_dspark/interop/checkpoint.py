"""Hugging Face drafter checkpoints: ``config.json`` plus safetensors (one file or a sharded index).

:func:`read_checkpoint` opens a checkpoint directory with the ``safetensors`` package and checks
that every file is complete before anything else looks at it; :func:`normalize_config` turns the
three config schemas DSpark/DFlash drafters ship with into one view:

* the DFlash-lineage schema: a nested ``dflash_config`` (``target_layer_ids``, ``mask_token_id``,
  ``block_size``, ...);
* the flat DSpark schema: ``target_layer_ids`` / ``mask_token_id`` at the top level;
* the ``speculators`` / EAGLE3-style schema: the layer hyper-parameters in
  ``transformer_layer_config``, ``aux_hidden_state_layer_ids`` (one above the HF layer ids), and
  ``sample_from_anchor`` defaulting to false.

Every problem is a :class:`CheckpointError` naming the file, key or tensor.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from pyllama_dspark.errors import ModelFileError

__all__ = ["CheckpointError", "Checkpoint", "read_checkpoint", "normalize_config", "DSPARK_ARCHS", "DFLASH_ARCHS"]

#: ``architectures`` llama.cpp's converter handles as DSpark (``DSparkModel``) / plain DFlash
DSPARK_ARCHS = ("Qwen3DSparkModel", "DSparkDraftModel", "DSparkSpeculator", "Lfm2DSparkDraftModel", "LingDSparkModel")
DFLASH_ARCHS = ("DFlashDraftModel", "DFlash2DraftModel")

_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "BOOL": np.bool_,
           "BF16": None, "F64": np.float64}


class CheckpointError(ModelFileError):
    """A drafter checkpoint is incomplete, corrupt, or does not fit the target."""


@dataclass
class Checkpoint:
    """A checkpoint directory: its raw config and where each tensor lives."""

    path: str
    config: Dict[str, Any]
    files: Dict[str, str] = field(default_factory=dict)                  # tensor -> safetensors file
    dtypes: Dict[str, str] = field(default_factory=dict)                 # tensor -> safetensors dtype
    shapes: Dict[str, Tuple[int, ...]] = field(default_factory=dict)

    def tensor(self, name: str) -> np.ndarray:
        """The tensor as numpy (BF16 widened to F32, exactly); other dtypes as stored."""
        path = self.files[name]
        if self.dtypes[name] == "BF16":
            off, (b0, b1) = _header(path)[0], _header(path)[1][name]["data_offsets"]
            raw = np.fromfile(path, dtype=np.uint16, count=(b1 - b0) // 2, offset=off + b0)
            return (raw.astype(np.uint32) << 16).view(np.float32).reshape(self.shapes[name])
        from safetensors import safe_open

        try:
            with safe_open(path, framework="numpy") as f:
                return f.get_tensor(name)
        except Exception as exc:   # noqa: BLE001 -- the package raises a bare SafetensorError
            raise CheckpointError(f"{os.path.basename(path)}: cannot read tensor {name!r}: {exc}") from exc


def _header(path: str) -> Tuple[int, Dict[str, Any]]:
    """(offset of the data section, header dict) of a safetensors file."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return 8 + n, json.loads(fh.read(n))


def _load_json(path: str, what: str) -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint has no {what}: {path!r}") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{what} is not valid JSON ({path!r}): {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} must hold a JSON object: {path!r}")
    return data


def _scan_file(ck: Checkpoint, path: str) -> None:
    from safetensors import safe_open

    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"safetensors file {name!r} is missing from {ck.path!r}")
    try:
        with safe_open(path, framework="numpy") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                dtype, shape = str(sl.get_dtype()), tuple(int(x) for x in sl.get_shape())
                if dtype not in _DTYPES:
                    raise CheckpointError(f"{name}: tensor {key!r} has unsupported dtype {dtype}")
                if key in ck.files:
                    raise CheckpointError(f"tensor {key!r} is stored twice ({ck.files[key]!r} and {name!r})")
                ck.files[key], ck.dtypes[key], ck.shapes[key] = path, dtype, shape
    except CheckpointError:
        raise
    except Exception as exc:   # noqa: BLE001 -- SafetensorError / OSError: truncated or corrupt
        raise CheckpointError(f"safetensors file {name!r} is truncated or corrupt: {exc}") from exc


def read_checkpoint(path) -> Checkpoint:
    """Open a checkpoint directory (``config.json`` + ``model.safetensors`` or a sharded index)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory not found: {path!r}")
    ck = Checkpoint(path=path, config=_load_json(os.path.join(path, "config.json"), "config.json"))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        wmap = _load_json(index, "model.safetensors.index.json").get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            raise CheckpointError(f"model.safetensors.index.json has no weight_map: {index!r}")
        for shard in sorted(set(wmap.values())):
            _scan_file(ck, os.path.join(path, shard))
        missing = sorted(set(wmap) - set(ck.files))
        if missing:
            raise CheckpointError(f"tensor {missing[0]!r} is listed in the index but in no shard"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        for key, shard in wmap.items():
            if os.path.basename(ck.files[key]) != shard:
                raise CheckpointError(f"tensor {key!r} is indexed in {shard!r} but stored in "
                                      f"{os.path.basename(ck.files[key])!r}")
    else:
        shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not shards:
            raise CheckpointError(f"checkpoint {path!r} has no .safetensors file")
        for shard in shards:
            _scan_file(ck, os.path.join(path, shard))
    return ck


def _need(cfg: Dict[str, Any], key: str, kind=int):
    if key not in cfg or cfg[key] is None:
        raise CheckpointError(f"config.json lacks {key!r}")
    try:
        return kind(cfg[key])
    except (TypeError, ValueError):
        raise CheckpointError(f"config.json {key!r} must be {kind.__name__}, got {cfg[key]!r}") from None


def _ints(values, key: str) -> List[int]:
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                        for v in values):
        raise CheckpointError(f"config.json {key!r} must be a list of integers, got {values!r}")
    return [int(v) for v in values]


def normalize_config(raw: Dict[str, Any]) -> Dict[str, Any]:
    """One view of the three schemas (see the module doc).  Keys of the result:

    ``kind`` ("dspark" | "dflash"), ``arch``, ``hidden_size``, ``intermediate_size``, ``n_layers``,
    ``n_head``, ``n_head_kv``, ``head_dim``, ``rms_eps``, ``rope_theta``, ``n_ctx``, ``vocab_size``,
    ``draft_vocab_size``, ``block_size``, ``target_layer_ids`` (HF, 0-based), ``mask_token_id``,
    ``sample_from_anchor``, ``dflash`` (the nested dflash_config), ``hp`` (merged hyper-parameters).
    """
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in DSPARK_ARCHS + DFLASH_ARCHS:
        raise CheckpointError(f"config.json 'architectures' is {archs!r}: not a DSpark/DFlash drafter "
                              f"(known: {', '.join(DSPARK_ARCHS + DFLASH_ARCHS)})")
    kind = "dspark" if arch in DSPARK_ARCHS else "dflash"
    speculators = "transformer_layer_config" in raw or "aux_hidden_state_layer_ids" in raw
    sample_from_anchor = bool(raw.get("sample_from_anchor", not speculators))
    hp = dict(raw)
    if isinstance(raw.get("transformer_layer_config"), dict):
        hp.update(raw["transformer_layer_config"])
    if "dflash_config" in hp and not isinstance(hp["dflash_config"], dict):
        raise CheckpointError("config.json 'dflash_config' must be an object")
    dfc = dict(hp.get("dflash_config") or {})
    if "dflash_config" not in hp:
        if "aux_hidden_state_layer_ids" in hp:
            dfc = {"mask_token_id": hp.get("mask_token_id"),
                   "target_layer_ids": [i - 1 for i in _ints(hp["aux_hidden_state_layer_ids"],
                                                             "aux_hidden_state_layer_ids")]}
        else:
            dfc = {k: hp[k] for k in ("target_layer_ids", "mask_token_id") if k in hp}
    mht = hp.get("markov_head_type", "vanilla")
    if kind == "dspark" and mht != "vanilla":
        raise CheckpointError(f"config.json 'markov_head_type' is {mht!r}: only 'vanilla' is supported")
    layers = dfc.get("target_layer_ids", hp.get("target_layer_ids"))
    if not layers:
        raise CheckpointError("config.json lacks 'target_layer_ids' (dflash_config.target_layer_ids, or "
                              "aux_hidden_state_layer_ids in the speculators schema)")
    n_head = _need(hp, "num_attention_heads")
    hidden = _need(hp, "hidden_size")
    head_dim = int(hp.get("head_dim") or hidden // n_head)
    vocab = _need(hp, "vocab_size")
    draft_vocab = int(hp.get("draft_vocab_size") or vocab) if kind == "dspark" else vocab
    if draft_vocab > vocab:
        raise CheckpointError(f"config.json 'draft_vocab_size' {draft_vocab} exceeds 'vocab_size' {vocab}")
    mask = dfc.get("mask_token_id")
    rope_params = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    rope_theta = hp.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    return {
        "kind": kind, "arch": arch, "hp": hp, "dflash": dfc,
        "hidden_size": hidden, "intermediate_size": _need(hp, "intermediate_size"),
        "n_layers": _need(hp, "num_hidden_layers"), "n_head": n_head,
        "n_head_kv": int(hp.get("num_key_value_heads") or n_head), "head_dim": head_dim,
        "rms_eps": _need(hp, "rms_norm_eps", float), "rope_theta": float(rope_theta),
        "rope_params": rope_params,
        "n_ctx": _need(hp, "max_position_embeddings"), "vocab_size": vocab, "draft_vocab_size": draft_vocab,
        "block_size": int(dfc.get("block_size", hp.get("block_size", 16))),
        "target_layer_ids": _ints(layers, "target_layer_ids"),
        "mask_token_id": None if mask is None else int(mask),
        "sample_from_anchor": sample_from_anchor,
    }


def expected_shapes(cfg: Dict[str, Any], markov_rank: Optional[int]) -> Dict[str, Tuple[int, ...]]:
    """HF tensor name (without ``model.``) -> shape, for the tensors every such drafter must have."""
    d, hd, ff = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["n_head"] * hd, cfg["n_head_kv"] * hd
    out: Dict[str, Tuple[int, ...]] = {
        "fc.weight": (d, len(cfg["target_layer_ids"]) * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for i in range(cfg["n_layers"]):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                    p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                    p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
                    p + "mlp.down_proj.weight": (d, ff)})
    if cfg["kind"] == "dspark":
        out["markov_head.markov_w1.weight"] = (cfg["vocab_size"], markov_rank)
        out["markov_head.markov_w2.weight"] = (cfg["draft_vocab_size"], markov_rank)
    if cfg["draft_vocab_size"] < cfg["vocab_size"]:
        out["lm_head.weight"] = (cfg["draft_vocab_size"], d)
        out["d2t"] = (cfg["draft_vocab_size"],)
    return out


def optional_shapes(cfg: Dict[str, Any], markov_rank: Optional[int]) -> Dict[str, Optional[Tuple[int, ...]]]:
    """Tensors a drafter may have (None: shape not checked)."""
    d = cfg["hidden_size"]
    out: Dict[str, Optional[Tuple[int, ...]]] = {"embed_tokens.weight": (cfg["vocab_size"], d),
                                                 "t2d": (cfg["vocab_size"],)}
    if cfg["draft_vocab_size"] == cfg["vocab_size"]:
        out["lm_head.weight"] = (cfg["vocab_size"], d)   # dropped: the target's output head is shared
    if cfg["kind"] == "dspark":
        out["confidence_head.proj.weight"] = (1, d + int(markov_rank or 0))
        out["confidence_head.proj.bias"] = (1,)
    for i in range(cfg["n_layers"]):
        out[f"layers.{i}.self_attn.sinks"] = (cfg["n_head"],)
        if "conv_kernel_size" in cfg["dflash"]:   # DFlash2 (shapes not checked)
            for part in ("attention_conv", "mlp_conv"):
                out[f"layers.{i}.{part}.base_kernel"] = None
                out[f"layers.{i}.{part}.kernel_projection.weight"] = None
    if "conv_kernel_size" in cfg["dflash"]:
        for n in ("predecessor_codebook", "successor_codebook", "hidden_projection.weight"):
            out[f"candidate_selector.{n}"] = None
    return out


def strip_model_prefix(names: List[str]) -> Dict[str, str]:
    """checkpoint name -> name without a leading ``model.`` (how llama.cpp's converter reads both)."""
    return {n: (n[len("model."):] if n.startswith("model.") else n) for n in names}
