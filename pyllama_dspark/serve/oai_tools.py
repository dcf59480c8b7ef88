"""A chat request's tool fields: ``tools``, ``tool_choice``, ``parallel_tool_calls`` and
``chat_template_kwargs`` (llama-server's names and defaults), checked with the conversation's
``tool_calls`` / ``tool_call_id`` (:mod:`~pyllama_dspark.chat.tool_request`): every mistake is a
400 that says what is wrong.

As llama-server: ``tools`` together with ``grammar`` is refused unless ``tool_choice`` is "none", and
``logprobs`` with tools and ``stream`` is refused.
Unlike it, ``json_schema`` / a JSON ``response_format`` together with tools is refused too
(llama-server silently drops the tools for the schema)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

from pyllama_dspark.serve.oai_errors import RequestError, _typename
from pyllama_dspark.chat.tool_request import check_tool_choice, check_tool_messages, check_tools

__all__ = ["ToolFields", "parse_tool_fields"]


@dataclass
class ToolFields:
    tools: List[dict] = field(default_factory=list)
    choice: Union[str, dict] = "auto"            # "none" | "auto" | "required" | {"name": ...}
    parallel: Optional[bool] = None              # None: what the template can render (llama-server)
    template_kwargs: Dict[str, Any] = field(default_factory=dict)


def parse_tool_fields(body: dict, messages: Sequence[dict]) -> Optional[ToolFields]:
    """The tool fields of a chat body (None when it has none and its messages carry no tool
    turns); RequestError (400)."""
    keys = ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs")
    has_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if all(body.get(k) is None for k in keys) and not has_turns:
        return None
    try:
        tools = check_tools(body.get("tools"))
        choice = check_tool_choice(body.get("tool_choice"), tools)
        check_tool_messages(messages)
    except ValueError as e:
        param = "messages" if str(e).startswith("messages[") else "tools"
        raise RequestError(str(e), param=param) from None
    par = body.get("parallel_tool_calls")
    if par is not None and not isinstance(par, bool):
        raise RequestError(f"'parallel_tool_calls' must be a boolean, got {_typename(par)}",
                           param="parallel_tool_calls")
    kw = body.get("chat_template_kwargs")
    if kw is not None and not isinstance(kw, dict):
        raise RequestError(f"'chat_template_kwargs' must be an object, got {_typename(kw)}",
                           param="chat_template_kwargs")
    if tools and body.get("stream") is True and body.get("logprobs") is True:
        raise RequestError("logprobs is not supported with tools + stream", param="logprobs")   # as llama-server
    if tools and choice != "none":
        if body.get("grammar") is not None:
            raise RequestError("Cannot use custom grammar constraints with tools.", param="grammar")
        rf = body.get("response_format")
        if body.get("json_schema") is not None or (isinstance(rf, dict) and rf.get("type") in ("json_object",
                                                                                                "json_schema")):
            raise RequestError("a JSON schema / JSON response_format cannot be combined with tools "
                               "(tool_choice other than \"none\"): the reply is either calls or the schema's JSON",
                               param="tools")
    return ToolFields(tools, choice, par, dict(kw or {}))
