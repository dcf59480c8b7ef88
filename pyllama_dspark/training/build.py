"""Build a trainable draft for a target GGUF: shapes from its metadata, frozen tensors from its file."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from pyllama_dspark.gguf.reader import read_gguf
from pyllama_dspark.gguf.target_info import read_target_info
from pyllama_dspark.gguf.testing import default_target_layers, pick_mask_token_id

__all__ = ["target_tensor", "make_spec", "build_model", "feature_scale"]


def target_tensor(target_path: str, name: str) -> np.ndarray:
    """A target tensor dequantized to float32, numpy shape = reversed ggml ne."""
    import gguf

    r = read_gguf(target_path)
    for t in r.tensors:
        if t.name == name:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            return np.asarray(arr, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
    raise KeyError(f"{target_path} has no tensor {name!r}")


def make_spec(target_path: str, n_layers: int = 1, block_size: int = 7, markov_rank: int = 32,
              target_layers: Optional[Sequence[int]] = None):
    from pyllama_dspark.training.model import DraftSpec

    ti = read_target_info(target_path)
    layers = list(target_layers) if target_layers else default_target_layers(ti.n_layer)
    return DraftSpec(n_embd=ti.n_embd, n_head=ti.n_head, n_head_kv=ti.n_head_kv, head_dim=ti.head_dim,
                     n_ff=ti.n_ff, n_layers=int(n_layers), block_size=int(block_size),
                     markov_rank=int(markov_rank), rope_base=float(ti.rope_freq_base),
                     rms_eps=float(ti.rms_eps or 1e-6), n_vocab=ti.n_vocab,
                     n_feat=len(layers) * ti.n_embd, target_layers=layers,
                     mask_token_id=int(pick_mask_token_id(read_gguf(target_path))))


def feature_scale(records, max_rows: int = 60000, floor: float = 1e-3) -> np.ndarray:
    """Per-dimension RMS of the captured features over (up to ``max_rows`` rows of) the records."""
    rows, acc = 0, None
    for r in records:
        f = r.feats.astype(np.float64)
        sq = (f * f).sum(0)
        acc = sq if acc is None else acc + sq
        rows += f.shape[0]
        if rows >= max_rows:
            break
    return np.maximum(np.sqrt(acc / max(1, rows)), floor).astype(np.float32)


def build_model(target_path: str, spec, d2t: np.ndarray, train_head: bool = False,
                init_from_layer: Optional[int] = -1, seed: int = 0, feat_scale: Optional[np.ndarray] = None):
    """A :class:`DSparkDraft` whose frozen embeddings (and lm_head rows for ``d2t``) come from the
    target's ``token_embd`` (or ``output.weight`` when the target has an untied head); its FFN is
    initialized from target layer ``init_from_layer`` (-1 = the last; None = random)."""
    import torch

    from pyllama_dspark.training.model import DSparkDraft

    emb = target_tensor(target_path, "token_embd.weight")
    try:
        head_full = target_tensor(target_path, "output.weight")
    except KeyError:
        head_full = emb
    model = DSparkDraft(spec, emb, d2t, head_full[np.asarray(d2t)], train_head=train_head, seed=seed,
                        feat_scale=feat_scale)
    if init_from_layer is not None:
        ti = read_target_info(target_path)
        il = init_from_layer % ti.n_layer
        with torch.no_grad():
            for L in model.layers:
                for ours, theirs in (("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down"),
                                     ("ffn_norm", "ffn_norm")):
                    w = target_tensor(target_path, f"blk.{il}.{theirs}.weight")
                    getattr(L, ours).copy_(torch.from_numpy(np.array(w)))
    return model
