"""The exported GGUF run by llama.cpp against the PyTorch model it came from, block by block.

For a token sequence: the target prefills it with feature capture; the draft gets the features of
positions ``< a`` injected and decodes the block ``[x_a, mask...]`` at ``a``; llama.cpp's rows
(logits after the Markov head, which conditions on its own argmax chain, and the confidences) are
compared with the torch model fed the same features and the same conditioning tokens (the anchor,
then llama.cpp's argmax chain).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import numpy as np

__all__ = ["BlockDiff", "compare_blocks"]


@dataclass
class BlockDiff:
    anchor: int
    max_abs_logit: float      # over the draft vocabulary rows
    logit_scale: float        # std of llama.cpp's logits (same rows)
    max_abs_conf: float
    argmax_equal: int
    argmax_near_tie: int      # disagreements where the torch top-2 margin < 2 * max_abs_logit
    rows: int


def compare_blocks(model, target_path: str, gguf_path: str, tokens: Sequence[int],
                   anchors: Sequence[int], n_threads: int = 2) -> List[BlockDiff]:
    import torch

    from pyllama_dspark.llama.handles import ContextSettings, Draft, Target

    toks = np.asarray(tokens, dtype=np.int32)
    B = model.spec.block_size
    d2t = model.d2t.numpy()
    out: List[BlockDiff] = []
    st = ContextSettings(n_ctx=max(256, len(toks) + B + 8), n_batch=max(512, len(toks)),
                         n_ubatch=max(512, len(toks)), n_threads=n_threads)
    with Target(target_path, st, capture_layers=list(model.spec.target_layers)) as tgt:
        tgt.decode(toks, 0)
        feats = tgt.features(0, len(toks))
        with Draft(gguf_path, tgt) as dr:
            for a in anchors:
                a = int(a)
                dr.seq_rm(0, 0, -1)
                dr.inject(feats[:a], np.arange(a, dtype=np.int32))
                block = np.array([toks[a]] + [model.spec.mask_token_id] * (B - 1), dtype=np.int32)
                dr.decode_block(block, a)
                ll_logits = np.stack([dr.logits(i)[d2t] for i in range(B)])
                conf = np.zeros(B, dtype=np.float32)
                dr.confidence(0, B, conf)
                chain = d2t[ll_logits.argmax(-1)]
                seq = np.concatenate([toks[: a + 1], chain[: B - 1]]).astype(np.int64)
                with torch.no_grad():
                    u, h, w1p = model.forward_blocks(torch.from_numpy(feats[:a]), torch.from_numpy(seq),
                                                     torch.tensor([a]))
                    c = model.confidence(h, w1p)[0].numpy()
                tu = u[0].numpy()
                diff = np.abs(tu - ll_logits)
                mad = float(diff.max())
                top2 = np.sort(tu, axis=-1)[:, -2:]
                margin = top2[:, 1] - top2[:, 0]
                eq = tu.argmax(-1) == ll_logits.argmax(-1)
                out.append(BlockDiff(anchor=a, max_abs_logit=mad, logit_scale=float(ll_logits.std()),
                                     max_abs_conf=float(np.abs(c - conf).max()), argmax_equal=int(eq.sum()),
                                     argmax_near_tie=int(((~eq) & (margin < 2 * mad)).sum()), rows=B))
    return out
