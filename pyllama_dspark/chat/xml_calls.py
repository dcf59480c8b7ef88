"""Qwen3-Coder XML tool calls (a codec of :mod:`.tool_codecs`): Qwen3.5 / 3.6, Qwen3-Coder, NVIDIA
Nemotron 3 Nano (llama.cpp's ``common/parsers/qwen3-coder.cpp``)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Reading a reply follows llama-server's parser and its mapper to JSON (``common/chat-peg-parser.cpp``):

* a template with ``<think>`` (Qwen3.5, Nemotron 3): the prompt opens the reasoning block (``lstrip``
  True) or closes it (``enable_thinking: false``, ``lstrip`` False).  Opened: the reasoning is the
  text up to ``</think>`` or ``<tool_call>`` (leading whitespace skipped, the rest kept; to the end
  of the text when neither comes), whitespace-only reasoning dropped;
* then, whitespace skipped, the content up to the first ``<tool_call>`` (Qwen3-Coder: or
  ``<function=NAME>`` of a tool, its first call may leave out ``<tool_call>``), then the calls, each
  followed by whitespace; a call that does not parse ends them and it and what follows is dropped
  (llama-server drops it too); a text that ends inside a call gives that call as far as it goes;
* each call's arguments become compact JSON ``{"key":value,...}`` in the order written: a parameter
  whose schema admits only strings is the raw text up to ``\\n</parameter>\\n`` (JSON-escaped); one
  that admits no string a JSON value as written; one that admits both tries JSON (of the other
  types it admits) first, then falls back to the text.  The required parameters come first (any
  order, once each), then the optional ones (any number of times, repeats kept as llama-server keeps
  them); an unknown parameter, or a missing required one, fails the call.

The parameter types come from the request's tools (``tools``, bound by :func:`.tool_codecs.parser`);
with only ``names`` every parameter is read as admitting anything.  The grammar: :mod:`.xml_grammar`.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

from pyllama_dspark.chat.formats import ToolFormat
from pyllama_dspark.chat.parse import Reply, ToolCall, _Bad, _Cut, _esc, _held_back, _skip_ws
from pyllama_dspark.chat.xml_grammar import ALL, ARG_CLOSE, CALL_CLOSE, CALL_OPEN, grammar, params_of, value_types

__all__ = ["grammar", "parse", "WANTS_TOOLS", "CALL_OPEN", "CALL_CLOSE", "STEPFUN", "trim_messages"]

WANTS_TOOLS = True        # :func:`.tool_codecs.parser` binds the request's tools (parameter types)
_SPACE = " \t\n\r"
FUNC, FUNC_CLOSE, PARAM = "<function=", "</function>\n", "<parameter="
_CONSTANT = json.JSONDecoder(parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))

Params = Optional[List[Tuple[str, FrozenSet[str], bool]]]    # None: any parameter, any type


def _schemas(names, tools) -> Optional[Dict[str, Params]]:
    if tools:
        out: Dict[str, Params] = {}
        for t in tools:
            params, props = params_of(t)
            out[t["function"]["name"]] = [(k, value_types(v, params), r) for k, v, r in props]
        return out
    return None if names is None else {n: None for n in names}


def _json_at(s: str, i: int) -> Tuple[object, int]:
    """The JSON value at ``s[i]`` (no whitespace before it): (value, end); ValueError."""
    if i >= len(s) or s[i] in _SPACE:
        raise ValueError("no JSON value")
    return _CONSTANT.raw_decode(s, i)


def _kind_ok(v: object, types: FrozenSet[str]) -> bool:
    """A JSON alternative llama-server tries for a mixed-type parameter (no JSON string among them)."""
    if isinstance(v, bool):
        return "boolean" in types
    if v is None:
        return "null" in types
    if isinstance(v, (int, float)):
        return bool({"number", "integer"} & types)
    if isinstance(v, list):
        return "array" in types
    if isinstance(v, dict):
        return "object" in types
    return False


def _prefix_at_end(s: str, i: int, *words: str) -> bool:
    """The text from ``i`` on is the start of one of ``words`` (it may still come)."""
    return any(w.startswith(s[i:]) for w in words)


class _Call:
    """One call's arguments, read from ``<function=NAME>\\n`` on into ``out`` (JSON text)."""

    def __init__(self, s: str, params: Params, partial: bool):
        self.s, self.params, self.partial, self.out = s, params, partial, ["{"]

    def args(self, p: int) -> int:
        s, params = self.s, self.params
        req = {k for k, _, r in params if r} if params is not None else set()
        by_name = {k: (t, r) for k, t, r in params} if params is not None else {}
        seen: set = set()
        n = 0
        while True:
            if s.startswith(FUNC_CLOSE, p):
                if req - seen:
                    raise _Bad
                return p + len(FUNC_CLOSE)
            if not s.startswith(PARAM, p):
                if _prefix_at_end(s, p, FUNC_CLOSE, PARAM):
                    raise _Cut
                raise _Bad
            q = p + len(PARAM)
            e = s.find(">", q)
            if e < 0:
                raise _Cut
            key = s[q:e]
            if params is None:
                types = ALL
            else:
                if key not in by_name:
                    raise _Bad
                types, required = by_name[key]
                if required and key in seen or (not required and req - seen):
                    raise _Bad        # required ones first, once each
                seen.add(key)
            if not s.startswith(">\n", e):
                if e + 1 == len(s):
                    raise _Cut
                raise _Bad
            self.out.append(("," if n else "") + json.dumps(key, ensure_ascii=False) + ":")
            n += 1
            p = self.value(e + 2, types)

    def value(self, p: int, types: FrozenSet[str]) -> int:
        s = self.s
        if "string" not in types:
            try:
                v, e = _json_at(s, p)
            except ValueError:
                if s.find(ARG_CLOSE, p) < 0:
                    raise _Cut from None   # the text ends inside the value (or it is no value: the close decides)
                raise _Bad from None
            if e == len(s) and isinstance(v, (int, float)) and not isinstance(v, bool):
                if not self.partial:   # the number may go on: shown once the text is final
                    self.out.append(s[p:e])
                raise _Cut
            if not s.startswith(ARG_CLOSE, e):
                if _prefix_at_end(s, e, ARG_CLOSE):
                    self.out.append(s[p:e])
                    raise _Cut
                raise _Bad
            self.out.append(s[p:e])
            return e + len(ARG_CLOSE)
        e = s.find(ARG_CLOSE, p)
        if types == frozenset(("string",)):
            if e < 0:
                self.out.append('"' + _esc(_held_back(s[p:], ARG_CLOSE)))
                raise _Cut
            self.out.append('"' + _esc(s[p:e]) + '"')
            return e + len(ARG_CLOSE)
        if e < 0:
            raise _Cut                  # JSON or text: known at the close
        raw = s[p:e]
        try:
            v, end = _json_at(raw, 0)
            ok = end == len(raw) and _kind_ok(v, types)
        except ValueError:
            ok = False
        self.out.append(raw if ok else '"' + _esc(raw) + '"')
        return e + len(ARG_CLOSE)


def _one(s: str, p: int, schemas: Optional[Dict[str, Params]], partial: bool) -> Tuple[Optional[ToolCall], int]:
    """The call at ``<function=`` (``s[p]``): (the call or None (not one, or no name yet), the index
    after it and its ``</tool_call>``; len(s) when the text ends inside it)."""
    if not s.startswith(FUNC, p):
        return None, p
    q = p + len(FUNC)
    e = s.find(">", q)
    if e < 0:
        return None, len(s)
    name = s[q:e]
    if schemas is not None and name not in schemas:
        return None, p
    c = _Call(s, schemas.get(name) if schemas is not None else None, partial)
    try:
        if not s.startswith(">\n", e):
            if e + 1 == len(s):
                raise _Cut
            raise _Bad
        end = c.args(e + 2)
        c.out.append("}")              # llama-server closes the arguments at </function>
        if not s.startswith(CALL_CLOSE, end):
            if _prefix_at_end(s, end, CALL_CLOSE):
                raise _Cut
            raise _Bad
    except _Cut:
        return ToolCall(name, "".join(c.out), complete=False), len(s)
    except _Bad:
        return None, p
    return ToolCall(name, "".join(c.out)), end + len(CALL_CLOSE)


def _calls(s: str, k: int, coder: bool, schemas, partial: bool) -> List[ToolCall]:
    out: List[ToolCall] = []
    p = k
    while p < len(s):
        if s.startswith(CALL_OPEN + "\n", p):
            p += len(CALL_OPEN) + 1
        elif not (coder and not out and s.startswith(FUNC, p)):
            break
        call, end = _one(s, p, schemas, partial)
        if call is None:
            break
        out.append(call)
        if not call.complete:
            break
        p = _skip_ws(s, end)
    return out


def _split_reasoning(s: str, fmt: ToolFormat, partial: bool, opened: bool) -> Tuple[str, int]:
    """(the reasoning, where the rest starts)."""
    if fmt.think is None or not opened:
        return "", 0
    close = fmt.think[1]
    j = _skip_ws(s, 0)
    ends = [(k, m) for k, m in ((s.find(close, j), close), (s.find(CALL_OPEN, j), CALL_OPEN)) if k >= 0]
    if not ends:
        r = s[j:]
        if partial:
            r = _held_back(_held_back(r, close), CALL_OPEN)
        return r, len(s)
    k, m = min(ends)
    return s[j:k], k + len(close) if m == close else k


def parse(text: str, fmt: ToolFormat, names=None, *, partial: bool = False, lstrip: bool = True,
          calls: bool = True, tools: Optional[Sequence[dict]] = None) -> Reply:
    """:func:`.parse.parse_reply`'s contract (module doc).  ``lstrip``: the prompt left the reasoning
    block open (a template with ``<think>``; False: it closed it); ``tools``: the request's tools
    (the parameter types); ``calls`` False (``tool_choice: "none"``): reasoning and content only."""
    s = text
    reasoning, i = _split_reasoning(s, fmt, partial, lstrip)
    if reasoning.strip(_SPACE) == "":
        reasoning = ""
    i = _skip_ws(s, i)
    if not calls:
        return Reply(s[i:], reasoning)
    coder = fmt.think is None
    schemas = _schemas(names, tools)
    starts = [CALL_OPEN]
    if coder:
        starts += [f"{FUNC}{n}>" for n in schemas] if schemas is not None else [FUNC]
    found = [k for k in (s.find(m, i) for m in starts) if k >= 0]
    if not found:
        content = s[i:]
        if partial:
            for m in starts:
                content = _held_back(content, m)
        return Reply(content, reasoning)
    k = min(found)
    return Reply(s[i:k], reasoning, _calls(s, k, coder, schemas, partial))


def trim_messages(msgs: List[dict]) -> List[dict]:
    """StepFun 3.5's conversation as llama.cpp renders it: every message's content and reasoning
    trimmed of surrounding whitespace (``workaround::trim_all_content``)."""
    out = []
    for m in msgs:
        m = dict(m)
        for k in ("content", "reasoning_content"):
            if isinstance(m.get(k), str):
                m[k] = m[k].strip(_SPACE + "\v\f")
        out.append(m)
    return out


# StepFun 3.5 Flash (its template describes the tools "in JSONSchema format"): the same calls, the
# conversation trimmed as llama.cpp trims it
STEPFUN = SimpleNamespace(grammar=grammar, parse=parse, WANTS_TOOLS=True, adjust_messages=trim_messages)
