"""LFM2 / LFM2.5 tool calls (a codec of :mod:`.tool_codecs`):
``<|tool_call_start|>[f(a="x", n=1), g()]<|tool_call_end|>``.

Liquid's models write their calls as a Python list of calls, each ``name(key=value, ...)``: strings
between ``"`` or ``'`` (JSON escapes, ``\\'`` / ``\\"``), numbers as in JSON, ``True`` / ``False`` /
``None`` or their JSON spellings, lists and dicts of those.  An optional ``<think>`` block comes
first where the template has one (LFM2.5).  Reading a reply follows llama.cpp's LFM2 parser
(``common/parsers/lfm2.cpp``, ``python_style_tool_calls`` in ``common/chat-peg-parser.cpp``): a small
PEG evaluator here has the same lenient semantics (a text that ends early is read as far as it goes),
and the mapper assembles each call's arguments JSON as llama.cpp's does (``{"key":`` and the value's
text with Python quotes and literals turned into JSON, whitespace as written, the object closed when
the call's ``)`` is reached).  As in llama.cpp, a call's name, an argument's ``name=`` and the call's
``)`` count only once all there, so a text so far parses as its end will (``partial`` changes nothing):
nothing sent while streaming changes later.

The grammar (:func:`grammar`): :mod:`.lfm2_grammar`.
"""

from __future__ import annotations

import json
import string
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from pyllama_dspark.chat.formats import ToolFormat
from pyllama_dspark.chat.lfm2_grammar import CALL_END, CALL_START, THINK_END, THINK_START, grammar
from pyllama_dspark.chat.parse import Reply, ToolCall

__all__ = ["grammar", "parse", "adjust_messages", "WANTS_TOOLS", "CALL_START", "CALL_END"]

WANTS_TOOLS = True        # :func:`.tool_codecs.parser` binds the request's tools (argument names and types)

_WORD = set(string.ascii_letters + string.digits + "_")


def adjust_messages(msgs: List[dict]) -> List[dict]:
    """llama.cpp's LFM2 handler copies ``reasoning_content`` to ``thinking``, where the template reads it."""
    return [{**m, "thinking": m["reasoning_content"]} if isinstance(m.get("reasoning_content"), str) else m
            for m in msgs]


# the PEG evaluator: :mod:`.peg`
from pyllama_dspark.chat.peg import (CSPACE as _CSPACE, FAIL, MORE, OK, Parser, Result, alt as _alt,  # noqa: E402
                                     brace_depth as _brace_depth, chars as _chars, end as _end, eps as _eps,
                                     json_number, lit as _lit, rep as _rep, seq as _seq,
                                     space as _space, string_inside as _strc, until as _until)
Node = Tuple[str, int, int, bool, list]       # (tag, start, end, ended early, children)


def _tag(tag: str, q: Parser, atomic: bool = False) -> Parser:
    """A tagged node; ``atomic``: none while its text is not all there (llama.cpp's atomic tags)."""
    def p(s: str, i: int) -> Result:
        st, e, n = q(s, i)
        if st == FAIL:
            return st, e, n
        return st, e, ([] if atomic and st == MORE else [(tag, i, e, st == MORE, n)])
    return p


def _ref(get: Callable[[], Parser]) -> Parser:
    return lambda s, i: get()(s, i)


_PSTR = _alt(_seq(_lit('"'), _strc('"'), _lit('"')), _seq(_lit("'"), _strc("'"), _lit("'")))
_VALUE: Parser = _ref(lambda: _VALUE_DEF)
_MEMBER = _seq(_PSTR, _space, _lit(":"), _space, _VALUE)
_DICT = _seq(_lit("{"), _space, _alt(_lit("}"), _seq(_MEMBER, _rep(_seq(_space, _lit(","), _space, _MEMBER)),
                                                     _space, _lit("}"))), _space)
_ARRAY = _seq(_lit("["), _space, _alt(_lit("]"), _seq(_VALUE, _rep(_seq(_lit(","), _space, _VALUE)),
                                                      _space, _lit("]"))), _space)
_VALUE_DEF = _alt(_DICT, _ARRAY, _PSTR, json_number, *(_lit(w) for w in ("True", "False", "None", "true", "false", "null")))
_IDENT = _chars(lambda c: c not in "=(),[]{}\"'<>" and c not in _CSPACE)


def _arg(name: Parser, value: Parser) -> Parser:
    return _tag("arg", _seq(_tag("arg_open", _seq(_tag("arg_name", name, True), _lit("=")), True),
                            _tag("arg_value", value), _tag("arg_close", _eps, True)))


def _call(name: Parser, props: Optional[Dict[str, Any]] = None) -> Parser:
    """One call; ``props``: the tool's properties (llama-server's parser: one of their names per
    argument, at least one argument where there are any, a "string"-typed one a quoted string), None:
    any argument names and values."""
    if props is None:
        arg = _arg(_IDENT, _VALUE)
        args = _alt(_seq(arg, _rep(_seq(_lit(","), _space, arg))), _eps)
    elif not props:
        args = _eps
    else:
        arg = _alt(*(_arg(_lit(k), _PSTR if isinstance(v, dict) and v.get("type") == "string" else _VALUE)
                     for k, v in props.items()))
        args = _seq(arg, _rep(_seq(_lit(","), _space, arg)))
    return _tag("tool", _seq(_tag("tool_open", _seq(_tag("tool_name", name, True), _lit("(")), True), _space,
                             _tag("tool_args", args), _space, _tag("tool_close", _lit(")"), True)))


_PARSERS: Dict[Tuple[Any, bool, bool], Parser] = {}


def _root(names: Optional[Tuple[str, ...]], think: bool, calls: bool, tools: Optional[Sequence[dict]] = None) -> Parser:
    key = (json.dumps(tools, sort_keys=True) if tools is not None else names, think, calls)
    if len(_PARSERS) > 256:
        _PARSERS.clear()
    if key not in _PARSERS:
        reasoning = _rep(_seq(_lit(THINK_START), _tag("reasoning", _until(THINK_END)), _lit(THINK_END)), 0, 1) \
            if think else _eps
        if not calls:
            _PARSERS[key] = _seq(reasoning, _tag("content", lambda s, i: (OK, len(s), [])), _end)
        else:
            if tools is not None:
                tool = _alt(*(_call(_lit(t["function"]["name"]), _props(t)) for t in tools))
            else:
                tool = _call(_IDENT) if names is None else _alt(*(_call(_lit(n)) for n in names))
            lst = _seq(_lit("["), _space, tool, _rep(_seq(_lit(","), _space, tool)), _space, _lit("]"))
            _PARSERS[key] = _seq(reasoning, _tag("content", _until(CALL_START)),
                                 _seq(_lit(CALL_START), lst, _lit(CALL_END)), _end)
    return _PARSERS[key]


def _props(tool: dict) -> Dict[str, Any]:
    params = tool["function"].get("parameters")
    props = params.get("properties") if isinstance(params, dict) else None
    return props if isinstance(props, dict) else {}


# ---- the mapper (common_chat_peg_mapper::map) ---------------------------------------------------------
def _to_json(v: str) -> str:
    """llama.cpp's normalize_quotes_to_json: Python quotes and literals -> JSON, the rest as written."""
    out: List[str] = []
    sq = dq = False
    i, n = 0, len(v)
    while i < n:
        c = v[i]
        if c == "\\" and i + 1 < n:
            nx = v[i + 1]
            if sq or dq:
                out.append("'" if sq and nx == "'" else '\\"' if sq and nx == '"' else c + nx)
                i += 2
            else:
                out.append(c)
                i += 1
            continue
        if c == '"':
            if sq:
                out.append('\\"')
            else:
                dq = not dq
                out.append(c)
        elif c == "'":
            if not dq:
                sq = not sq
            out.append("'" if dq else '"')
        elif not sq and not dq and c in "TFN" and (i == 0 or v[i - 1] not in _WORD):
            k = i
            while k < n and v[k] in _WORD:
                k += 1
            word = v[i:k]
            for py, js in (("True", "true"), ("False", "false"), ("None", "null")):
                if py[:len(word)] == word:
                    out.append(js[:len(word)])
                    i = k - 1
                    break
            else:
                out.append(c)
        else:
            out.append(c)
        i += 1
    return "".join(out)


class _Map:
    def __init__(self, s: str):
        self.s = s
        self.content: List[str] = []
        self.reasoning: List[str] = []
        self.calls: List[ToolCall] = []
        self.n_args = 0

    def visit(self, node: Node) -> None:
        tag, start, end, more, kids = node
        text = self.s[start:end]
        if tag == "reasoning":
            self.reasoning.append(text)
        elif tag == "content":
            self.content.append(text)
        elif tag == "tool_open":
            self.n_args = 0
        elif tag == "tool_name":
            self.calls.append(ToolCall(text.rstrip(_CSPACE), "{", complete=False))
        elif tag == "arg_name" and self.calls:
            self._add(("," if self.n_args else "") + json.dumps(text.strip(_CSPACE), ensure_ascii=False) + ":")
            self.n_args += 1
        elif tag == "arg_value" and self.calls and text:
            self._add(_to_json(text))
        elif tag == "tool_close" and self.calls:
            c = self.calls[-1]
            c.arguments += "}" * max(_brace_depth(c.arguments), 0)
            c.complete = True
        for k in kids:
            self.visit(k)

    def _add(self, text: str) -> None:
        self.calls[-1].arguments += text


def parse(text: str, fmt: ToolFormat, names=None, *, partial: bool = False, lstrip: bool = True,
          calls: bool = True, tools: Optional[Sequence[dict]] = None) -> Reply:
    """:func:`.parse.parse_reply`'s contract (module doc); ``partial`` and ``lstrip`` are not used:
    llama-server's LFM2 parser keeps a reply's leading whitespace, and reads a text so far as its end.
    ``calls`` False (``tool_choice: "none"``): reasoning, and the rest as content; so is a text
    llama-server's parser rejects (it answers HTTP 500).  ``tools``: the request's tools, for
    llama-server's exact parser (their argument names and types); without them any argument is read."""
    think = fmt.think is not None
    root = _root(None if names is None else tuple(names), think, calls, tools)
    try:
        st, _, nodes = root(text, 0)
    except RecursionError:     # values nested beyond Python's stack: not read as calls
        st = FAIL
    if st == FAIL:       # read as without calls (its thought stays reasoning, as it streamed)
        st, _, nodes = _root(None, think, False)(text, 0)
    m = _Map(text)
    for n in nodes:
        m.visit(n)
    reasoning = "".join(m.reasoning)
    if not reasoning.strip(" \n\r\t"):
        reasoning = ""
    return Reply("".join(m.content), reasoning, m.calls)
