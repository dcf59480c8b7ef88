"""Gemma 4's tool calls (a codec of :mod:`.tool_codecs`): ``<|tool_call>call:NAME{key:value,...}<tool_call|>``.

Gemma 4 writes a call's arguments in its own dict syntax, not JSON: keys bare (``city:``), strings
between ``<|"|>`` tokens (no escapes inside), numbers / ``true`` / ``false`` / ``null`` as in JSON,
arrays ``[a,b]`` and nested dicts ``{k:v}``.  Reading a reply follows llama.cpp's Gemma 4 parser
(``common/parsers/gemma4.cpp``) and its mapper to JSON (``common/chat-peg-parser.cpp``):

* the reply is a run of messages, each an optional thought (``<|channel>thought`` ... ``<channel|>``,
  the reasoning; whitespace after ``thought`` skipped, the rest kept) and content up to the next
  ``<|channel>`` / ``<channel|>`` / ``<|tool_call>``; a ``<|channel>`` that opens no thought, or a
  stray ``<channel|>``, ends the run and the text up to the first ``<|tool_call>`` is dropped;
* then the calls, back to back; a call of an unknown tool, or one that does not parse, ends them and
  what follows is dropped (no leading whitespace is stripped, unlike the JSON formats);
* each call's arguments become compact JSON: keys and strings JSON-escaped, numbers as written,
  whitespace after ``{`` ``[`` ``,`` ``:`` and before ``}`` ``]`` dropped.

The grammar (:func:`grammar`) is built from each tool's parameters schema (llama-server's admits any
dict there; docs/serve.md "Tools"): keys in the order Gemma's template renders them (sorted),
optional ones may be left out, whitespace where llama-server's grammar allows it.  The conversation:
:mod:`.gemma4_chat`.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any, List, Optional, Sequence

from pyllama_dspark.chat.formats import ToolFormat
from pyllama_dspark.chat.gemma4_chat import adjust_messages, adjust_prompt, legacy_messages
from pyllama_dspark.chat.schema_gbnf import SchemaWalker
from pyllama_dspark.chat.tool_grammar import ToolGrammar, ToolSchemaError, calls_of, lit, until_rules, with_root
from pyllama_dspark.chat.parse import Reply, ToolCall, _Bad, _Cut, _esc, _held_back, _skip_ws

__all__ = ["grammar", "parse", "adjust_messages", "adjust_prompt", "LEGACY", "CALL_OPEN", "CALL_CLOSE", "QUOTE"]

CALL_OPEN, CALL_CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
CH_OPEN, CH_CLOSE, THOUGHT = "<|channel>", "<channel|>", "<|channel>thought"
_PREFIX = CALL_OPEN + "call:"
_SPACE = " \t\n\r\v\f"      # C isspace
_NUM = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUM_MORE = set("0123456789.eE+-")


# ---- the grammar ------------------------------------------------------------------------------------
# llama-server's own rules for any Gemma value (its whole argument grammar), whitespace and all
_GENERIC = [
    'space ::= | " " | "\\n"{1,2} [ \\t]{0,20}',
    'gv ::= gs | gd | ga | gn | gb | "null"',
    'gd ::= "{" space ("}" | gkv ("," space gkv)* space "}")',
    'gkv ::= gk ":" space gv',
    'gk ::= [^:}]+',
    'ga ::= "[" space ("]" | gv ("," space gv)* space "]")',
    'gn ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? (("e" | "E") [+-]? [0-9]+)?',
    'gi ::= "-"? ("0" | [1-9] [0-9]*)',
    'gb ::= "true" | "false"',
    f'gs ::= {lit(QUOTE)} gsc-0',
] + until_rules("gsc", QUOTE)


def _gemma(v: Any, where: str) -> str:
    """A JSON value in Gemma's syntax (enum / const literals)."""
    if isinstance(v, str):
        if QUOTE in v:
            raise ToolSchemaError(f"{where}: a string holding {QUOTE!r} cannot be written")
        return QUOTE + v + QUOTE
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    if isinstance(v, (int, float)):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ",".join(_gemma(x, where) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(_key(k, where) + ":" + _gemma(x, where) for k, x in v.items()) + "}"
    raise ToolSchemaError(f"{where}: unsupported value {v!r}")


def _key(k: str, where: str) -> str:
    if not k or any(c in k for c in ":{}<>") or k[0] in _SPACE:
        raise ToolSchemaError(f"{where}: the property name {k!r} cannot be written as a Gemma 4 key")
    return k


class _Gen(SchemaWalker):
    """JSON schema -> GBNF rules for values in Gemma's syntax."""

    ANY, ANY_DICT, NULL = "gv", "gd", '"null"'
    SIMPLE = {"string": "gs", "number": "gn", "integer": "gi", "boolean": '("true" | "false")', "null": '"null"'}
    SEP = '"," space'

    def literal(self, v: Any) -> List[str]:
        return [lit(_gemma(v, self.where))]

    def key(self, k: str) -> str:
        return lit(_key(k, self.where) + ":")

    def order(self, props: dict) -> List[str]:
        return sorted(props, key=lambda k: (k.lower(), k))   # the template's dictsort


def grammar(fmt: ToolFormat, tools: Sequence[dict], choice: Any, parallel: bool,
            think: bool = True) -> Optional[ToolGrammar]:
    """:func:`.tool_grammar.tool_grammar`'s contract, for Gemma 4's calls (module doc)."""
    if (pick := calls_of(tools, choice, parallel)) is None:
        return None
    use, many = pick
    rules, alts = list(_GENERIC), []
    for i, t in enumerate(use):
        name = t["function"]["name"]
        if any(c in name for c in "{}<>:") or name != name.strip():
            raise ToolSchemaError(f"tool {name!r}: the name cannot be written in a Gemma 4 call")
        gen = _Gen.for_tool(t, i)
        params = gen.root
        with gen.guarded():
            body = gen.value(params) if ("$ref" in params or "anyOf" in params or "oneOf" in params) \
                else gen.object(params, 0)
        rules += gen.rules
        rules.append(f"call-{i} ::= {lit(name)} {body}")
        alts.append(f"call-{i}")
    rules.append("call ::= " + " | ".join(alts))
    rules.append(f"one-call ::= {lit(_PREFIX)} call {lit(CALL_CLOSE)}")
    rules.append("calls ::= one-call" + (" one-call*" if many else ""))
    # a thought may come first, as in llama-server's grammar (also after a prompt that closed one)
    thought = [f"root ::= ({lit(THOUGHT)} space think-0)? calls"] + until_rules("think", CH_CLOSE)
    return with_root(rules, choice, (CALL_OPEN,), thought)


# ---- the parser ---------------------------------------------------------------------------------------
class _ToJson:
    """One call's arguments (a Gemma dict) -> JSON text in ``out`` (llama.cpp's gemma4_to_json)."""

    def __init__(self, s: str, partial: bool):
        self.s, self.out, self.partial = s, [], partial

    def _more(self, i: int) -> int:
        if i >= len(self.s):
            raise _Cut
        return i

    def value(self, i: int) -> int:
        s = self.s
        i = self._more(i)
        if s.startswith(QUOTE, i):
            e = s.find(QUOTE, i + len(QUOTE))
            if e < 0:
                self.out.append('"' + _esc(_held_back(s[i + len(QUOTE):], QUOTE)))
                raise _Cut
            self.out.append('"' + _esc(s[i + len(QUOTE):e]) + '"')
            return e + len(QUOTE)
        if QUOTE.startswith(s[i:]):
            raise _Cut
        if s[i] == "{":
            return self.seq(i, "{", "}", True)
        if s[i] == "[":
            return self.seq(i, "[", "]", False)
        m = _NUM.match(s, i)
        if m:
            e = m.end()
            if e >= len(s):       # the number may go on: shown once the text is final
                if not self.partial:
                    self.out.append(m.group())
                raise _Cut
            if s[e] in _NUM_MORE:
                raise _Bad
            self.out.append(m.group())
            return e
        for w in ("true", "false", "null"):
            if s.startswith(w, i):
                self.out.append(w)
                return i + len(w)
            if w.startswith(s[i:]):
                raise _Cut
        if all(c in _NUM_MORE for c in s[i:]):
            raise _Cut
        raise _Bad

    def seq(self, i: int, open_: str, close: str, keyed: bool) -> int:
        s = self.s
        self.out.append(open_)
        i = self._more(_skip_ws(s, i + 1, _SPACE))
        if s[i] == close:
            self.out.append(close)
            return i + 1
        while True:
            if keyed:
                j = i
                while j < len(s) and s[j] not in ":}":
                    j += 1
                if j == i:
                    raise _Bad
                self.out.append('"' + _esc(s[i:j]))
                if j >= len(s):
                    raise _Cut
                if s[j] != ":":
                    raise _Bad
                self.out.append('":')
                i = _skip_ws(s, j + 1, _SPACE)
            i = self._more(self.value(i))
            if s[i] == ",":
                self.out.append(",")
                i = _skip_ws(s, i + 1, _SPACE)
                continue
            i = self._more(_skip_ws(s, i, _SPACE))
            if s[i] != close:
                raise _Bad
            self.out.append(close)
            return i + 1


def _name_at(s: str, j: int, names: Optional[List[str]]) -> Optional[str]:
    if names is None:
        e = s.find("{", j)
        return s[j:e] if e > j else None
    for n in names:
        if s.startswith(n, j) and s.startswith("{", j + len(n)):
            return n
    return None


def _calls(s: str, i: int, names: Optional[List[str]], partial: bool) -> List[ToolCall]:
    out: List[ToolCall] = []
    while s.startswith(_PREFIX, i):
        j = i + len(_PREFIX)
        name = _name_at(s, j, names)
        if name is None:
            break
        conv = _ToJson(s, partial)
        try:
            e = conv.seq(j + len(name), "{", "}", True)
        except _Cut:
            out.append(ToolCall(name, "".join(conv.out), complete=False))
            break
        except _Bad:
            break
        if s.startswith(CALL_CLOSE, e):
            out.append(ToolCall(name, "".join(conv.out)))
            i = e + len(CALL_CLOSE)
            continue
        if CALL_CLOSE.startswith(s[e:]):      # the text ends before the call's end
            out.append(ToolCall(name, "".join(conv.out), complete=False))
        break
    return out


def parse(text: str, fmt: ToolFormat, names=None, *, partial: bool = False, lstrip: bool = True,
          calls: bool = True) -> Reply:
    """:func:`.parse.parse_reply`'s contract (module doc); ``lstrip`` is not used: llama-server's
    Gemma 4 parser keeps a reply's leading whitespace.  ``calls`` False (``tool_choice: "none"``):
    content runs on over ``<|tool_call>`` (llama-server's parser without tools), no calls."""
    s = text
    stops = (CH_OPEN, CH_CLOSE, CALL_OPEN) if calls else (CH_OPEN, CH_CLOSE)
    names = None if names is None else list(names)
    content: List[str] = []
    reasoning: List[str] = []
    i = 0
    while i < len(s):
        start = i
        if s.startswith(CH_OPEN, i) or (partial and CH_OPEN.startswith(s[i:])):
            j = i
            while s.startswith(CH_OPEN, j) and not THOUGHT.startswith(s[j:j + len(THOUGHT)]):
                j += len(CH_OPEN)
            if j + len(THOUGHT) > len(s) and THOUGHT.startswith(s[j:]):
                return Reply("".join(content), "".join(reasoning))   # maybe a thought to come
            if not s.startswith(THOUGHT, j):
                break
            k = _skip_ws(s, j + len(THOUGHT), _SPACE)
            e = s.find(CH_CLOSE, k)
            if e < 0:   # llama.cpp's lenient parse: the thought so far
                reasoning.append(_held_back(s[k:], CH_CLOSE) if partial else s[k:])
                return Reply("".join(content), "".join(reasoning))
            reasoning.append(s[k:e])
            i = e + len(CH_CLOSE)
        ends = [e for e in (s.find(m, i) for m in stops) if e >= 0]
        e = min(ends, default=len(s))
        piece = s[i:e]
        if partial and e == len(s):
            for m in stops:
                piece = _held_back(piece, m)
        content.append(piece)
        i = e
        if i == start:
            break
    k = s.find(CALL_OPEN, i) if calls else -1
    return Reply("".join(content), "".join(reasoning), _calls(s, k, names, partial) if k >= 0 else [])


# the codec of an older template: the same calls, the conversation rewritten
LEGACY = SimpleNamespace(grammar=grammar, parse=parse, adjust_prompt=adjust_prompt,
                         adjust_messages=lambda msgs: adjust_messages(legacy_messages(msgs)))
