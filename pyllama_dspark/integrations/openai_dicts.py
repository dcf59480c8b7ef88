"""Response dicts in llama-cpp-python's (OpenAI-style) completion schema, plus llama-server timings.

Completion: ``{"id": "cmpl-…", "object": "text_completion", "created", "model", "choices": [{"text",
"index": 0, "logprobs": None, "finish_reason"}], "usage": {"prompt_tokens", "completion_tokens",
"total_tokens"}}``; stream chunks carry one ``choices[0].text`` piece each and ``finish_reason``
None, then a last chunk with empty text and the finish reason.  Chat dicts are made from these by
llama-cpp-python's own chat handlers (see :mod:`pyllama_dspark.integrations.dspark`).

``timings`` follows llama-server's ``/completion`` and ``/v1/*`` responses: prompt_n, prompt_ms,
prompt_per_token_ms, prompt_per_second, predicted_n, predicted_ms, predicted_per_token_ms,
predicted_per_second, draft_n, draft_n_accepted (and cache_n, always 0 here).
"""

from __future__ import annotations

import time
import uuid
from typing import Optional

from pyllama_dspark.decode.timings import llama_timings
from pyllama_dspark.decode.cycle import Stats


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4()}"


def now() -> int:
    return int(time.time())


def timings(stats: Stats) -> dict:
    """llama-server's ``timings`` object from the engine's Stats (``cache_n`` as llama-server has it)."""
    return {"cache_n": 0, **llama_timings(stats)}


def usage(n_prompt: int, n_completion: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
            "total_tokens": n_prompt + n_completion}


def completion(cid: str, created: int, model: str, text: str, finish_reason: str, usage_: dict,
               timings_: Optional[dict]) -> dict:
    out = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage_,
    }
    if timings_ is not None:
        out["timings"] = timings_
    return out


def completion_chunk(cid: str, created: int, model: str, text: str, finish_reason: Optional[str] = None,
                     usage_: Optional[dict] = None, timings_: Optional[dict] = None) -> dict:
    out = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
    }
    if usage_ is not None:
        out["usage"] = usage_
    if timings_ is not None:
        out["timings"] = timings_
    return out
