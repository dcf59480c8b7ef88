"""Chat prompts exactly as llama-cpp-python's ``Llama.create_chat_completion`` builds them.

``Llama`` picks a chat format from the GGUF metadata: a built-in formatter when
``guess_chat_format_from_gguf_metadata`` recognizes the template, otherwise a
``Jinja2ChatFormatter`` over ``tokenizer.chat_template`` with the vocabulary's EOS/BOS text; the
prompt is then tokenized with ``add_bos = not added_special`` and special tokens parsed.  We reuse
those very classes so the token ids match.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from llama_cpp import llama_chat_format as lcf
from llama_cpp import llama_cpp as ll

from pyllama_dspark.llama.handles import Target


@dataclass
class ChatPrompt:
    tokens: List[int]
    text: str
    stop: List[str]


def model_metadata(target: Target) -> Dict[str, str]:
    """All GGUF key/value strings of the target, like ``Llama.metadata``."""
    out: Dict[str, str] = {}
    buf = ctypes.create_string_buffer(1 << 20)
    n = ll.llama_model_meta_count(target.model)
    for i in range(n):
        kn = ll.llama_model_meta_key_by_index(target.model, i, buf, len(buf))
        if kn < 0:
            continue
        key = buf.value.decode("utf-8", "replace")
        vn = ll.llama_model_meta_val_str_by_index(target.model, i, buf, len(buf))
        if vn < 0:
            continue
        out[key] = buf.value.decode("utf-8", "replace")
    return out


def _token_text(target: Target, tok: int) -> str:
    if tok == -1:
        return ""
    return ll.llama_vocab_get_text(target.vocab, tok).decode("utf-8", "replace")


def chat_formatter(target: Target):
    meta = model_metadata(target)
    name = lcf.guess_chat_format_from_gguf_metadata(meta)
    if name is not None:
        fn = getattr(lcf, "format_" + name.replace("-", "_"), None)
        if fn is not None:
            return fn
    template = meta.get("tokenizer.chat_template")
    if template is None:
        # Llama falls back to the "llama-2" format when the GGUF has no template
        return lcf.format_llama2
    eos = ll.llama_vocab_eos(target.vocab)
    bos = ll.llama_vocab_bos(target.vocab)
    return lcf.Jinja2ChatFormatter(
        template=template, eos_token=_token_text(target, eos), bos_token=_token_text(target, bos),
        stop_token_ids=[eos])


def build_chat_prompt(target: Target, messages: Sequence[dict]) -> ChatPrompt:
    if not messages:
        raise ValueError("messages must not be empty")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError("each message needs 'role' and 'content'")
    result = chat_formatter(target)(messages=list(messages))
    tokens = target.tokenize(result.prompt.encode("utf-8"), add_special=not result.added_special,
                             parse_special=True)
    stop: List[str] = []
    if result.stop is not None:
        stop = list(result.stop) if isinstance(result.stop, list) else [result.stop]
    return ChatPrompt(tokens=tokens, text=result.prompt, stop=stop)
