"""Plain greedy decoding of the target through llama-cpp-python's ``Llama`` (the reference)."""

from __future__ import annotations

from typing import List, Sequence

import llama_cpp
import numpy as np

# like-for-like with our defaults (llama-server's): flash attention on, n_ctx 4096, n_batch 512
LLAMA_KW = dict(n_ctx=4096, n_batch=512, n_ubatch=512, flash_attn=True, verbose=False)


def open_llama(path: str):
    from llama_cpp import Llama

    return Llama(model_path=path, **LLAMA_KW)


def greedy(llm, prompt: Sequence[int], n: int) -> List[int]:
    """Up to n greedy tokens (stops after an end-of-generation token, which is included)."""
    llm.reset()
    out: List[int] = []
    for tok in llm.generate(list(prompt), temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok):
            break
        if len(out) >= n:
            break
    return out


def top2_margin(llm, prefix: Sequence[int]) -> float:
    """Gap between the best and second-best logit of the target after ``prefix``."""
    llm.reset()
    llm.eval(list(prefix))
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)  # Llama.scores is empty without logits_all
    row = np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float64)
    top = np.sort(row)[-2:]
    return float(top[1] - top[0])


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def explain_mismatch(llm, prompt: Sequence[int], ours: Sequence[int], ref: Sequence[int], tie_eps: float) -> str:
    i = first_divergence(ours, ref)
    margin = top2_margin(llm, list(prompt) + list(ref[:i]))
    kind = "NUMERICAL NEAR-TIE" if margin < tie_eps else "REAL DIVERGENCE (bug)"
    return (f"{kind}: first divergence at generated token {i}: ours {ours[i] if i < len(ours) else None} "
            f"vs target {ref[i] if i < len(ref) else None}; target top-2 logit margin there {margin:.5f}")
