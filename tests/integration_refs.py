"""Shared set-up of the llama-cpp-python integration tests: plain ``Llama`` references, prompts."""

from __future__ import annotations

from typing import List, Tuple

from llama_cpp import Llama

from greedy_ref import LLAMA_KW
from pyllama_dspark.prompts import load_prompts

THREADS = 1          # both sides (plain Llama and Llama with the plug-in) as validated: see REF_THREADS
N_TOKENS = 32
PER_FILE = 2         # 5 prompt files x 2 = 10 prompts
DSPARK_KW = dict(n_ctx=LLAMA_KW["n_ctx"], n_batch=LLAMA_KW["n_batch"], n_ubatch=LLAMA_KW["n_ubatch"],
                 flash_attn="on", n_threads=THREADS)


def open_llama(path: str, **kw) -> Llama:
    """A plain Llama with the comparison settings (flash attention on, n_ctx 4096, n_batch 512)."""
    args = dict(LLAMA_KW, n_threads=THREADS, n_threads_batch=THREADS)
    args.update(kw)
    return Llama(model_path=path, **args)


def chat_cases(per_file: int = PER_FILE) -> List[Tuple[str, list]]:
    items = load_prompts(limit_per_file=per_file)
    return [(f"{it.source}#{it.index}", [{"role": "user", "content": it.turns[0]}]) for it in items]


def greedy_chat(llm, messages, n: int = N_TOKENS, **kw) -> dict:
    return llm.create_chat_completion(messages, temperature=0.0, max_tokens=n, **kw)


def content(resp: dict) -> str:
    return resp["choices"][0]["message"]["content"]


def streamed_content(chunks) -> Tuple[str, list]:
    chunks = list(chunks)
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks), chunks
