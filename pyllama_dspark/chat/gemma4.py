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
from typing import Any, Dict, List, Optional, Sequence, Tuple

from pyllama_dspark.chat.formats import ToolFormat
from pyllama_dspark.chat.gemma4_chat import adjust_messages, adjust_prompt, legacy_messages
from pyllama_dspark.chat.tool_grammar import ToolGrammar, ToolSchemaError, until_rules
from pyllama_dspark.chat.parse import Reply, ToolCall, _held_back

__all__ = ["grammar", "parse", "adjust_messages", "adjust_prompt", "LEGACY", "CALL_OPEN", "CALL_CLOSE", "QUOTE"]

CALL_OPEN, CALL_CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
CH_OPEN, CH_CLOSE, THOUGHT = "<|channel>", "<channel|>", "<|channel>thought"
_PREFIX = CALL_OPEN + "call:"
_SPACE = " \t\n\r\v\f"      # C isspace
_NUM = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUM_MORE = set("0123456789.eE+-")


def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


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
    f'gs ::= {_lit(QUOTE)} gsc-0',
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


# what the grammar cannot say; a string's pattern / format / length are not kept (any string)
_REFUSED = ("allOf", "not", "if", "then", "else", "patternProperties", "prefixItems", "dependentSchemas")
_MAX_REPEAT = 64     # maxItems above this is not kept (GBNF repetitions expand into rules)


class _Gen:
    """JSON schema -> GBNF rules for values in Gemma's syntax."""

    def __init__(self, tool: str, root: dict, tid: int):
        self.tool, self.root, self.rules, self.refs, self.n, self._tid = tool, root, [], {}, 0, tid

    def _new(self, body: str) -> str:
        self.n += 1
        name = f"t{self._tid}-{self.n}"
        self.rules.append(f"{name} ::= {body}")
        return name

    def err(self, msg: str) -> ToolSchemaError:
        return ToolSchemaError(f"tool {self.tool!r}: {msg}")

    def value(self, s: Any, depth: int = 0) -> str:
        if depth > 32:
            raise self.err("its parameters schema nests too deeply")
        if s is True or s == {}:
            return "gv"
        if not isinstance(s, dict):
            raise self.err(f"unsupported schema {s!r}")
        for k in _REFUSED:
            if k in s:
                raise self.err(f"unsupported parameters schema keyword {k!r}")
        alts = self._alts(s, depth)
        if s.get("nullable") is True and "null" not in alts:
            alts.append('"null"')
        return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"

    def _alts(self, s: dict, depth: int) -> List[str]:
        where = f"tool {self.tool!r}"
        if "$ref" in s:
            return [self._ref(s["$ref"], depth)]
        if "const" in s:
            return [_lit(_gemma(s["const"], where))]
        if "enum" in s:
            if not isinstance(s["enum"], list) or not s["enum"]:
                raise self.err("an empty enum")
            return [_lit(_gemma(v, where)) for v in s["enum"]]
        for k in ("anyOf", "oneOf"):
            if k in s:
                return [self.value(x, depth + 1) for x in s[k]]
        t = s.get("type")
        if isinstance(t, list):
            return [self.value({**s, "type": x}, depth + 1) for x in t]
        if t is None:
            if "properties" in s:
                t = "object"
            elif "items" in s:
                t = "array"
            else:
                return ["gv"]
        if t == "string":
            return ["gs"]
        if t == "number":
            return ["gn"]
        if t == "integer":
            return ["gi"]
        if t == "boolean":
            return ['("true" | "false")']
        if t == "null":
            return ['"null"']
        if t == "array":
            return [self._array(s, depth)]
        if t == "object":
            return [self.object(s, depth)]
        raise self.err(f"unsupported type {t!r}")

    def _ref(self, ref: Any, depth: int) -> str:
        if ref in self.refs:
            return self.refs[ref]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise self.err(f"unsupported $ref {ref!r} (only local ones)")
        node: Any = self.root
        for part in (ref[2:].split("/") if ref != "#" else ()):
            if not isinstance(node, dict) or part not in node:
                raise self.err(f"unresolved $ref {ref!r}")
            node = node[part]
        self.n += 1
        name = f"t{self._tid}-{self.n}"
        self.refs[ref] = name
        self.rules.append(f"{name} ::= {self.value(node, depth + 1)}")
        return name

    def _array(self, s: dict, depth: int) -> str:
        item = self.value(s.get("items", True), depth + 1)
        lo, hi = int(s.get("minItems", 0)), s.get("maxItems")
        hi = None if hi is None or int(hi) > _MAX_REPEAT else int(hi)
        if lo > _MAX_REPEAT:
            raise self.err(f"minItems above {_MAX_REPEAT}")
        if hi is not None and hi < lo:
            raise self.err("maxItems < minItems")
        if hi == 0:
            return '"[" space "]"'
        more = f'("," space {item})' + (f"{{{max(lo - 1, 0)},}}" if hi is None else f"{{{max(lo - 1, 0)},{hi - 1}}}")
        if lo > 0:
            return self._new(f'"[" space {item} {more} space "]"')
        return self._new(f'"[" space ("]" | {item} {more} space "]")')

    def object(self, s: dict, depth: int) -> str:
        props = s.get("properties")
        if props is None:
            return "gd"
        if not isinstance(props, dict):
            raise self.err("'properties' is not an object")
        req = set(s.get("required") or ())
        keys = sorted(props, key=lambda k: (k.lower(), k))   # the template's dictsort
        kvs = [(self._new(f'{_lit(_key(k, f"tool {self.tool!r}") + ":")} space {self.value(props[k], depth + 1)}'),
                k in req) for k in keys]
        # seq(i, first, need): the members from i on (a rule, "" for none, None: impossible); first: none
        # written yet (no comma); need: at least one
        memo: Dict[Tuple[int, bool, bool], Optional[str]] = {}

        def seq(i: int, first: bool, need: bool) -> Optional[str]:
            if i == len(kvs):
                return None if need else ""
            key = (i, first, need)
            if key not in memo:
                kv, required = kvs[i]
                this = " ".join(x for x in ("" if first else '"," space', kv, seq(i + 1, False, False)) if x)
                skip = None if required else seq(i + 1, first, need)
                body = this if skip is None else (f"({this})?" if skip == "" else f"({this}) | {skip}")
                memo[key] = self._new(body)
            return memo[key]

        inner = seq(0, True, True)
        if inner is None:
            return '"{" space "}"'
        if any(r for _, r in kvs):
            return self._new(f'"{{" space {inner} space "}}"')
        return self._new(f'"{{" space ("}}" | {inner} space "}}")')


def grammar(fmt: ToolFormat, tools: Sequence[dict], choice: Any, parallel: bool,
            think: bool = True) -> Optional[ToolGrammar]:
    """:func:`.tool_grammar.tool_grammar`'s contract, for Gemma 4's calls (module doc)."""
    if choice == "none" or not tools:
        return None
    named = choice.get("name") if isinstance(choice, dict) else None
    use = [t for t in tools if t["function"]["name"] == named] if named else list(tools)
    rules, alts = list(_GENERIC), []
    for i, t in enumerate(use):
        name = t["function"]["name"]
        if any(c in name for c in "{}<>:") or name != name.strip():
            raise ToolSchemaError(f"tool {name!r}: the name cannot be written in a Gemma 4 call")
        params = t["function"].get("parameters")
        if params is None or params == {}:    # llama.cpp's common_chat_tool_parameters
            params = {"type": "object", "properties": {}}
        gen = _Gen(name, params, i)
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise gen.err("its parameters schema must be an object")
        try:
            body = gen.value(params) if ("$ref" in params or "anyOf" in params or "oneOf" in params) \
                else gen.object(params, 0)
        except RecursionError:
            raise gen.err("its parameters schema nests too deeply") from None
        except ToolSchemaError:
            raise
        except (TypeError, ValueError, AttributeError) as e:   # a schema's odd values (jsonschema let it by)
            raise gen.err(f"unsupported parameters schema: {e}") from None
        rules += gen.rules
        rules.append(f"call-{i} ::= {_lit(name)} {body}")
        alts.append(f"call-{i}")
    rules.append("call ::= " + " | ".join(alts))
    rules.append(f"one-call ::= {_lit(_PREFIX)} call {_lit(CALL_CLOSE)}")
    rules.append("calls ::= one-call" + (" one-call*" if parallel and not named else ""))
    if choice == "auto":
        rules.append("root ::= calls")
        return ToolGrammar("\n".join(rules) + "\n", True, (CALL_OPEN,), False)
    # a thought may come first, as in llama-server's grammar (also after a prompt that closed one)
    rules.append(f"root ::= ({_lit(THOUGHT)} space think-0)? calls")
    rules.extend(until_rules("think", CH_CLOSE))
    return ToolGrammar("\n".join(rules) + "\n", False)


# ---- the parser ---------------------------------------------------------------------------------------
class _Cut(Exception):
    """The text ends inside the value (what was converted so far stands, as llama.cpp's lenient parse)."""


class _Bad(Exception):
    """Not Gemma's syntax here."""


def _ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _SPACE:
        i += 1
    return i


def _esc(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)[1:-1]


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
        i = self._more(_ws(s, i + 1))
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
                i = _ws(s, j + 1)
            i = self._more(self.value(i))
            if s[i] == ",":
                self.out.append(",")
                i = _ws(s, i + 1)
                continue
            i = self._more(_ws(s, i))
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
            k = _ws(s, j + len(THOUGHT))
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
