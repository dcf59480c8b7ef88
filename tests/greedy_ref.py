"""Plain greedy decoding of the target through llama-cpp-python's ``Llama`` (the reference).

The decoding helpers are crosscheck's (users run the same comparison); tests add the settings."""

from __future__ import annotations

from typing import Sequence

from pyllama_dspark.crosscheck import first_divergence, plain_greedy as greedy, top2_margin  # noqa: F401

# like-for-like with our defaults (llama-server's): flash attention on, n_ctx 4096, n_batch 512
LLAMA_KW = dict(n_ctx=4096, n_batch=512, n_ubatch=512, flash_attn=True, verbose=False)


def open_llama(path: str):
    from llama_cpp import Llama

    return Llama(model_path=path, **LLAMA_KW)


def explain_mismatch(llm, prompt: Sequence[int], ours: Sequence[int], ref: Sequence[int], tie_eps: float) -> str:
    i = first_divergence(ours, ref)
    margin = top2_margin(llm, list(prompt) + list(ref[:i]))
    kind = "NUMERICAL NEAR-TIE" if margin < tie_eps else "REAL DIVERGENCE (bug)"
    return (f"{kind}: first divergence at generated token {i}: ours {ours[i] if i < len(ours) else None} "
            f"vs target {ref[i] if i < len(ref) else None}; target top-2 logit margin there {margin:.5f}")
