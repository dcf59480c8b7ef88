"""``DSpark.create_chat_completion(tools=...)``: the same calls as ``serve``.

The prompt, the grammar (strict for ``"required"`` / a named function, lazy for ``"auto"``) and the
parse are :mod:`pyllama_dspark.chat.tool_request`'s, as in ``serve``; the dicts are
llama-cpp-python's chat schema (``choices[0].message.tool_calls``, ``finish_reason: "tool_calls"``,
stream chunks with ``delta.tool_calls``) plus llama-server's ``timings``.  Legacy ``functions`` /
``function_call`` are read as ``tools`` / ``tool_choice``, as llama-cpp-python's handlers read them.
A request that cannot be honoured (a template whose tool format is not built, a tool schema the
converter cannot do, malformed tools or tool turns) raises ValueError.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable, Iterator, List, Optional, Sequence

from pyllama_dspark.decode.cycle import Chunk, Done
from pyllama_dspark.integrations import openai_dicts as oai
from pyllama_dspark.chat.tool_prompt import tool_chat_for
from pyllama_dspark.chat.parse import ReplyText, message_json
from pyllama_dspark.chat.tool_request import (ToolPlan, check_tool_choice, check_tool_messages, check_tools,
                                                     plan_tools)

__all__ = ["wants_tools", "tool_plan", "tool_chat"]


def legacy_tools(tools, tool_choice, functions, function_call):
    """(tools, tool_choice) with llama-cpp-python's reading of ``functions`` / ``function_call``."""
    if functions is not None and tools is None:
        tools = [{"type": "function", "function": f} for f in functions]
    if function_call is not None and tool_choice is None:
        if isinstance(function_call, str) and function_call in ("none", "auto"):
            tool_choice = function_call
        elif isinstance(function_call, dict) and "name" in function_call:
            tool_choice = {"type": "function", "function": {"name": function_call["name"]}}
    return tools, tool_choice


def wants_tools(messages: Sequence[dict], tools) -> bool:
    return bool(tools) or any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
                              for m in messages)


def tool_plan(target, messages, tools, tool_choice, parallel: Optional[bool] = None,
              template_kwargs: Optional[dict] = None) -> ToolPlan:
    """The checked plan of a chat request with tools (ValueError with the reason)."""
    tools = check_tools(tools)
    choice = check_tool_choice(tool_choice, tools)
    msgs = [dict(m, content=m.get("content") or "") for m in messages]
    check_tool_messages(msgs)
    return plan_tools(tool_chat_for(target), msgs, tools, choice, parallel, template_kwargs)


def _chat_chunk(cid: str, created: int, model: str, delta: dict, finish: Optional[str] = None) -> dict:
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def tool_chat(target, plan: ToolPlan, run: Callable[[List[int], Any], Iterator], *, stream: bool, model: str,
              n_completion: Callable[[Done], int], stop=None):
    """The chat completion (or its chunks) of ``plan``: ``run(tokens, grammar)`` decodes (the
    DSpark's engine) and yields Chunk / Done events; ``stop``: the request's stop strings."""
    tokens = target.tokenize(plan.prompt, add_special=not plan.added_special, parse_special=True)
    grammar = plan.compile(target)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    text = ReplyText(target.token_to_piece, target.is_eog, plan.special_ids(target), stops)
    differ = plan.differ()
    cid, created = f"chatcmpl-{uuid.uuid4()}", oai.now()

    def events():
        try:
            yield from run(tokens, grammar)
        finally:
            if grammar is not None and not isinstance(grammar, str):
                grammar.close()

    def final(done: Done):
        if differ is None:
            return {"role": "assistant", "content": done.text}, [], done.finish_reason
        reply, deltas = differ.finish(text.finish(), cut=done.finish_reason == "length")
        reason = "tool_calls" if reply.calls and done.finish_reason == "stop" else done.finish_reason
        return message_json(reply), deltas, reason

    if stream:
        return _chunks(events(), text, differ, final, cid, created, model, len(tokens), n_completion)
    done = None
    for ev in events():
        if isinstance(ev, Done):
            done = ev
    text.push(done.tokens)
    msg, _, reason = final(done)
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": reason}],
            "usage": oai.usage(len(tokens), n_completion(done)), "timings": oai.timings(done.stats)}


def _chunks(events, text, differ, final, cid, created, model, n_prompt, n_completion) -> Iterator[dict]:
    yield _chat_chunk(cid, created, model, {"role": "assistant"})
    for ev in events:
        if isinstance(ev, Chunk):
            if differ is None:
                if ev.text:
                    yield _chat_chunk(cid, created, model, {"content": ev.text})
                continue
            for d in differ.update(text.push(ev.tokens))[1]:
                yield _chat_chunk(cid, created, model, d)
        elif isinstance(ev, Done):
            _, deltas, reason = final(ev)
            for d in deltas:
                yield _chat_chunk(cid, created, model, d)
            last = _chat_chunk(cid, created, model, {}, reason)
            last["usage"] = oai.usage(n_prompt, n_completion(ev))
            last["timings"] = oai.timings(ev.stats)
            yield last
