"""Chat prompts with tools, rendered as llama-server ``--jinja`` renders them.

The model's own chat template gets the tool list and the conversation (``tool_calls`` of earlier
assistant turns, ``role: "tool"`` results) through llama-cpp-python's ``Jinja2ChatFormatter``, after
the normalisation llama.cpp's ``common_chat_templates_apply_jinja`` applies (``common/chat.cpp``):

* tools as ``{"type": "function", "function": {"name", "description" ("" if absent), "parameters"}}``;
* messages as ``common_chat_msg::to_json_oaicompat`` writes them back (``content`` "" when empty,
  ``tool_calls`` as ``{"type", "function": {"name", "arguments"}, "id"}``);
* ``developer`` -> ``system``; a template without a system role gets the system text merged into
  the next message; arguments given as JSON text become objects for a template that renders objects
  (``func_args_not_string``);
* extra template variables ``date_string`` / ``datetime`` (llama.cpp's extra context) and the
  request's ``chat_template_kwargs``.

A template with no tool syntax (:mod:`.formats` ``generic``) instead gets the tools described in
a system message, earlier calls written into the assistant text and tool results as user messages,
all in the ``<tool_call>`` form the reply is constrained to.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Dict, List, Optional, Sequence

from llama_cpp import llama_chat_format as lcf
from llama_cpp import llama_cpp as ll

from pyllama_dspark.chat.formats import (TemplateCaps, ToolFormat, UnsupportedToolFormat, detect_format,
                                                     probe_caps)

__all__ = ["ToolChat", "normalize_tools", "GENERIC_SYSTEM", "tool_chat_for"]

GENERIC_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


def normalize_tools(tools: Sequence[dict]) -> List[dict]:
    """Tools as llama.cpp hands them to the template (``common_chat_tools_to_json_oaicompat``)."""
    out = []
    for t in tools:
        f = t["function"]
        out.append({"type": "function", "function": {"name": f["name"], "description": f.get("description", ""),
                                                     "parameters": f.get("parameters", {})}})
    return out


def _message_json(m: dict) -> dict:
    """A message as llama.cpp writes it back (``common_chat_msg::to_json_oaicompat``)."""
    out: Dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
    if m.get("reasoning_content"):
        out["reasoning_content"] = m["reasoning_content"]
    if m.get("name"):
        out["name"] = m["name"]
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            tc: Dict[str, Any] = {"type": "function", "function": {"name": c["function"]["name"],
                                                                   "arguments": c["function"]["arguments"]}}
            if c.get("id"):
                tc["id"] = c["id"]
            calls.append(tc)
        out["tool_calls"] = calls
    return out


@dataclass
class _Rendered:
    prompt: str
    added_special: bool


class ToolChat:
    """One chat template with tools: its capabilities, its tool-call format, its rendering."""

    def __init__(self, template: Optional[str], bos: str, eos: str, plain=None):
        """``template``: the GGUF's ``tokenizer.chat_template`` (None: no template); ``plain``: the
        formatter the target uses without tools (``llama.chat.chat_formatter``), for the generic form."""
        self.template = template
        self._plain = plain
        self._jinja = (lcf.Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
                       if template is not None else None)
        self.caps = probe_caps(self._render_raw) if self._jinja is not None else TemplateCaps()
        try:
            self.format: Optional[ToolFormat] = detect_format(template or "", self.caps)
            self.unsupported: Optional[str] = None
        except UnsupportedToolFormat as e:
            self.format, self.unsupported = None, str(e)

    def _render_raw(self, messages, tools=None, **kw) -> str:
        now = datetime.now()
        kw.setdefault("date_string", now.strftime("%d %b %Y"))
        kw.setdefault("datetime", now.strftime("%b %d %Y"))
        kw.setdefault("enable_thinking", True)   # llama.cpp always passes it (Gemma 4 tests "is defined")
        # llama-server's default preserve_reasoning=true (common/arg.cpp) and the variables it sets
        # for templates (jinja caps_apply_preserve_reasoning: Nemotron 3's truncate_history_thinking ...)
        kw.setdefault("preserve_reasoning", True)
        pr = kw["preserve_reasoning"]
        if isinstance(pr, bool):
            for k, v in (("preserve_thinking", pr), ("clear_thinking", not pr), ("truncate_history_thinking", not pr),
                         ("drop_thinking", not pr)):
                kw.setdefault(k, v)
        return self._jinja(messages=messages, tools=tools, **kw).prompt

    def check(self) -> ToolFormat:
        """The format, or :class:`UnsupportedToolFormat` saying why there is none."""
        if self.format is None:
            raise UnsupportedToolFormat(self.unsupported or "this model has no chat template")
        return self.format

    def render(self, messages: Sequence[dict], tools: Optional[Sequence[dict]], *,
               template_kwargs: Optional[Dict[str, Any]] = None,
               adjust: Optional[Callable[[List[dict]], List[dict]]] = None) -> _Rendered:
        """The prompt text for ``messages`` (OpenAI dicts, already checked) with ``tools`` (None or
        empty: none); ``adjust``: the format's rewrite of the normalised messages (:mod:`.tool_codecs`);
        ValueError when the template refuses the conversation."""
        fmt = self.check() if tools else self.format
        if fmt is not None and fmt.system_tools:
            return self._render_generic(messages, tools)
        msgs = [_message_json(m) for m in messages]
        for m in msgs:
            if m["role"] == "developer":
                m["role"] = "system"
            for c in m.get("tool_calls", ()):
                a = c["function"]["arguments"]
                if self.caps.supports_object_arguments and isinstance(a, str):
                    c["function"]["arguments"] = json.loads(a)
        if not self.caps.supports_system_role and msgs and msgs[0]["role"] == "system":
            first = msgs.pop(0)
            if msgs:
                msgs[0]["content"] = first["content"] + "\n" + msgs[0]["content"]
        if adjust is not None:
            msgs = adjust(msgs)
        try:
            text = self._render_raw(msgs, tools=normalize_tools(tools) if tools else None, **(template_kwargs or {}))
        except Exception as e:   # the template's raise_exception (a ValueError) or a Jinja error
            raise ValueError(f"the chat template refused the conversation: {e}") from e
        return _Rendered(text, True)

    def _render_generic(self, messages: Sequence[dict], tools: Optional[Sequence[dict]]) -> _Rendered:
        desc = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in normalize_tools(tools or ()))
        system = GENERIC_SYSTEM.format(tools=desc)
        msgs: List[dict] = []
        for m in messages:
            role, content = m["role"], m.get("content") or ""
            if role == "developer":
                role = "system"
            if role == "tool":
                msgs.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
                continue
            if m.get("tool_calls"):
                parts = [content] if content else []
                for c in m["tool_calls"]:
                    a = c["function"]["arguments"]
                    a = json.loads(a) if isinstance(a, str) else a
                    parts.append("<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": a},
                                                              ensure_ascii=False) + "\n</tool_call>")
                content = "\n".join(parts)
            msgs.append({"role": role, "content": content})
        if tools:
            if msgs and msgs[0]["role"] == "system":
                msgs[0] = {"role": "system", "content": msgs[0]["content"] + "\n\n" + system}
            else:
                msgs.insert(0, {"role": "system", "content": system})
        plain = self._plain if self._plain is not None else self._jinja
        try:
            r = plain(messages=msgs)
        except Exception as e:
            raise ValueError(f"the chat template refused the conversation: {e}") from e
        return _Rendered(r.prompt, bool(r.added_special))


_CACHE: "weakref.WeakKeyDictionary[Any, ToolChat]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _token_text(vocab, tok: int) -> str:
    return "" if tok == -1 else ll.llama_vocab_get_text(vocab, tok).decode("utf-8", "replace")


def tool_chat_for(target) -> ToolChat:
    """The :class:`ToolChat` of a target (built once per target object: probing renders the
    template a few times)."""
    with _LOCK:
        tc = _CACHE.get(target)
    if tc is not None:
        return tc
    from pyllama_dspark.chat.prompt import chat_formatter, model_metadata

    template = model_metadata(target).get("tokenizer.chat_template")
    vocab = target.vocab
    bos, eos = _token_text(vocab, ll.llama_vocab_bos(vocab)), _token_text(vocab, ll.llama_vocab_eos(vocab))
    tc = ToolChat(template, bos, eos, plain=chat_formatter(target))
    with _LOCK:
        _CACHE[target] = tc
    return tc
