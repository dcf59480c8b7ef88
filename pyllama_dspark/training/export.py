"""Export a trained :class:`~.model.DSparkDraft` as a ``dflash`` GGUF that llama.cpp loads.

Layout as in ``src/models/dflash.cpp`` (see :func:`pyllama_dspark.gguf.testing.make_test_draft`, which
writes the metadata and tokenizer): ``fc.weight`` stays F32 (F16 overflows on the target's
activations; hazard 9 in DESIGN.md), norms and the confidence head F32, the layer matrices and the
draft's own lm_head (``output.weight``, rows of the reduced vocabulary ``d2t``) in ``weights_type``
(``q8_0`` by default: half the bytes of F16, and llama.cpp's CPU kernels are fastest on it),
the Markov head F16.  :func:`export_hf_beside` then writes the same draft as a Hugging Face
checkpoint (:func:`pyllama_dspark.interop.export.export_checkpoint`) in ``<stem>.hf/`` beside the GGUF.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Dict, Tuple

import numpy as np

from pyllama_dspark.gguf.testing import make_test_draft

__all__ = ["export_gguf", "export_hf_beside", "hf_dir_for", "WEIGHT_TYPES"]

WEIGHT_TYPES = ("f32", "f16", "q8_0")


def _np(t) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.float32)


def export_gguf(model, target_path: str, out_path: str, weights_type: str = "q8_0",
                name: str = "pyllama-dspark trained DSpark draft") -> str:
    if weights_type not in WEIGHT_TYPES:
        raise ValueError(f"weights_type must be one of {WEIGHT_TYPES}")
    s = model.spec
    mat = weights_type
    # q8_0 needs rows that are a multiple of 32 wide (true for every matrix here at d=576)
    w: Dict[str, Tuple[np.ndarray, str]] = {
        "fc.weight": (_np(model.fc_folded()), "f32"),
        "enc.output_norm.weight": (_np(model.enc_norm), "f32"),
        "output_norm.weight": (_np(model.out_norm), "f32"),
        "output.weight": (_np(model.head), mat),
        "d2t": (model.d2t.cpu().numpy().astype(np.int64), "i64"),
        "markov_w1.weight": (_np(model.w1), "f16"),
        "markov_w2.weight": (_np(model.w2), "f16"),
        "conf_proj.weight": (_np(model.conf_w), "f32"),
        "conf_proj.bias": (_np(model.conf_b), "f32"),
    }
    for i, L in enumerate(model.layers):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = (_np(L.attn_norm), "f32")
        w[p + "attn_q.weight"] = (_np(L.wq), mat)
        w[p + "attn_k.weight"] = (_np(L.wk), mat)
        w[p + "attn_v.weight"] = (_np(L.wv), mat)
        w[p + "attn_output.weight"] = (_np(L.wo), mat)
        w[p + "attn_q_norm.weight"] = (_np(L.q_norm), "f32")
        w[p + "attn_k_norm.weight"] = (_np(L.k_norm), "f32")
        w[p + "ffn_norm.weight"] = (_np(L.ffn_norm), "f32")
        w[p + "ffn_gate.weight"] = (_np(L.gate), mat)
        w[p + "ffn_up.weight"] = (_np(L.up), mat)
        w[p + "ffn_down.weight"] = (_np(L.down), mat)
    return make_test_draft(
        target_path, os.fspath(out_path), kind="dspark", n_layers=s.n_layers, block_size=s.block_size,
        markov_rank=s.markov_rank, confidence=True, target_layers=list(s.target_layers), fc_type="f32",
        overrides={"general.name": name, "tokenizer.ggml.mask_token_id": int(s.mask_token_id),
                   "@n_ff": s.n_ff, "@n_head": s.n_head, "@n_head_kv": s.n_head_kv,
                   "@head_dim": s.head_dim},
        weights=w)


_HF_FILES = {"config.json", "model.safetensors"}


def hf_dir_for(out_path) -> Path:
    """Where ``train`` puts the HF checkpoint of ``out_path``: ``draft.gguf`` -> ``draft.hf/``."""
    return Path(os.fspath(out_path)).with_suffix(".hf")


def export_hf_beside(out_path) -> str:
    """Export the draft GGUF at ``out_path`` as an HF checkpoint (config.json + model.safetensors) in
    :func:`hf_dir_for` ``(out_path)``; an earlier export there is replaced (a directory holding anything
    else is refused).  Returns the directory."""
    from pyllama_dspark.interop.export import export_checkpoint

    dst = hf_dir_for(out_path)
    if dst.exists() and (not dst.is_dir() or not set(os.listdir(dst)) <= _HF_FILES):
        raise RuntimeError(f"{dst} exists and is not an earlier checkpoint export (only {sorted(_HF_FILES)}): "
                           f"move it away")
    tmp = dst.with_name(dst.name + ".new")
    shutil.rmtree(tmp, ignore_errors=True)
    export_checkpoint(out_path, tmp)
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(tmp, dst)
    return str(dst)
