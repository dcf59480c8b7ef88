"""The grammar of LFM2 / LFM2.5 tool calls (for :mod:`.lfm2`, the codec): each tool's ``parameters``
schema as GBNF for ``<|tool_call_start|>[name(key=value, ...), ...]<|tool_call_end|>``.

llama-server's grammar (``python_style_tool_calls`` in ``common/chat-peg-parser.cpp``) lets any of a
tool's argument names come in any order, any number of times (at least one where there are any), a
``"string"``-typed one as a quoted string and any other as any Python-or-JSON value.  Ours follows the
schema: the properties in schema order, the required ones present, strings quoted either way, enums,
numbers, booleans, arrays and nested objects as the schema says, whitespace where llama-server's grammar
puts it (docs/serve.md "Tools").
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

from pyllama_dspark.chat.formats import ToolFormat
from pyllama_dspark.chat.tool_grammar import ToolGrammar, ToolSchemaError, until_rules

__all__ = ["grammar", "CALL_START", "CALL_END", "THINK_START", "THINK_END"]

CALL_START, CALL_END = "<|tool_call_start|>", "<|tool_call_end|>"
THINK_START, THINK_END = "<think>", "</think>"
_CSPACE = " \t\n\r\v\f"      # C isspace


def _g(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


# llama-server's string content, less raw control characters and the escape "\\ " (its grammar lets
# them in, but a raw newline makes the arguments' JSON invalid and its parser rejects "\\ ")
_STRC = r'( [^{q}\\\x00-\x1f] | "\\" ( [{q}\\/bfnrt] | "u" [0-9a-fA-F]{{4}} ) )*'
_COMMON = [
    'space ::= | " " | "\\n"{1,2} [ \\t]{0,20}',
    'lf-str ::= "\\"" ' + _STRC.format(q='"') + ' "\\"" | "\'" ' + _STRC.format(q="'") + ' "\'"',
    'lf-num ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [+-]? [0-9]+)?',
    'lf-int ::= "-"? ("0" | [1-9] [0-9]*)',
    'lf-bool ::= "True" | "False" | "true" | "false"',
    'lf-null ::= "None" | "null"',
    'lf-val ::= lf-dict | lf-arr | lf-str | lf-num | lf-bool | lf-null',
    'lf-dict ::= "{" space ("}" | lf-member (space "," space lf-member)* space "}") space',
    'lf-member ::= lf-str space ":" space lf-val',
    'lf-arr ::= "[" space ("]" | lf-val ("," space lf-val)* space "]") space',
]
_REFUSED = ("allOf", "not", "if", "then", "else", "patternProperties", "prefixItems", "dependentSchemas")
_MAX_REPEAT = 64


def _quoted(v: str) -> List[str]:
    """A string constant as the model may write it: in double or in single quotes."""
    inner = json.dumps(v, ensure_ascii=False)[1:-1]
    return ['"' + inner + '"', "'" + inner.replace('\\"', '"').replace("'", "\\'") + "'"]


def _literal(v: Any, where: str) -> List[str]:
    """The GBNF alternatives of a JSON constant (enum / const)."""
    if isinstance(v, str):
        return [_g(x) for x in _quoted(v)]
    if isinstance(v, bool):
        return [_g("True" if v else "False"), _g("true" if v else "false")]
    if v is None:
        return ['"None"', '"null"']
    if isinstance(v, (int, float)):
        return [_g(json.dumps(v))]
    if isinstance(v, (list, dict)):    # written as JSON text, as a container value ends: with space
        return [_g(json.dumps(v, ensure_ascii=False, separators=(",", ":"))) + " space"]
    raise ToolSchemaError(f"{where}: unsupported value {v!r}")


class _Gen:
    """JSON schema -> GBNF rules for values in the Python-ish syntax of LFM2's calls."""

    def __init__(self, tool: str, root: dict, tid: int):
        self.tool, self.root, self.rules, self.refs, self.n, self.tid = tool, root, [], {}, 0, tid

    def new(self, body: str) -> str:
        self.n += 1
        name = f"t{self.tid}-{self.n}"
        self.rules.append(f"{name} ::= {body}")
        return name

    def err(self, msg: str) -> ToolSchemaError:
        return ToolSchemaError(f"tool {self.tool!r}: {msg}")

    def value(self, s: Any, depth: int = 0, string_only: bool = False) -> str:
        if depth > 32:
            raise self.err("its parameters schema nests too deeply")
        if s is True or s == {}:
            return "lf-val"
        if not isinstance(s, dict):
            raise self.err(f"unsupported schema {s!r}")
        for k in _REFUSED:
            if k in s:
                raise self.err(f"unsupported parameters schema keyword {k!r}")
        alts = self._alts(s, depth)
        if s.get("nullable") is True and not string_only and "lf-null" not in alts:
            alts.append("lf-null")
        return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"

    def _alts(self, s: dict, depth: int) -> List[str]:
        where = f"tool {self.tool!r}"
        if "$ref" in s:
            return [self._ref(s["$ref"], depth)]
        if "const" in s:
            return _literal(s["const"], where)
        if "enum" in s:
            if not isinstance(s["enum"], list) or not s["enum"]:
                raise self.err("an empty enum")
            return [a for v in s["enum"] for a in _literal(v, where)]
        for k in ("anyOf", "oneOf"):
            if k in s:
                return [self.value(x, depth + 1) for x in s[k]]
        t = s.get("type")
        if isinstance(t, list):
            return [self.value({**s, "type": x}, depth + 1) for x in t]
        if t is None:
            t = "object" if "properties" in s else "array" if "items" in s else None
            if t is None:
                return ["lf-val"]
        simple = {"string": "lf-str", "number": "lf-num", "integer": "lf-int", "boolean": "lf-bool", "null": "lf-null"}
        if t in simple:
            return [simple[t]]
        if t == "array":
            return [self._array(s, depth)]
        if t == "object":
            return [self._object(s, depth)]
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
        name = f"t{self.tid}-{self.n}"
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
            return '("[" space "]" space)'
        more = f'("," space {item})' + (f"{{{max(lo - 1, 0)},}}" if hi is None else f"{{{max(lo - 1, 0)},{hi - 1}}}")
        if lo > 0:
            return self.new(f'"[" space {item} {more} space "]" space')
        return self.new(f'"[" space ("]" | {item} {more} space "]") space')

    def _object(self, s: dict, depth: int) -> str:
        props = s.get("properties")
        if props is None:
            return "lf-dict"
        if not isinstance(props, dict):
            raise self.err("'properties' is not an object")
        req = set(s.get("required") or ())
        kvs = [(self.new("(" + " | ".join(_g(q) for q in _quoted(k)) + f') space ":" space {self.value(v, depth + 1)}'),
                k in req) for k, v in props.items()]
        inner = _members(self, kvs, 'space "," space', need=True)
        if inner is None:
            return '("{" space "}" space)'
        if any(r for _, r in kvs):
            return self.new(f'"{{" space {inner} space "}}" space')
        return self.new(f'"{{" space ("}}" | {inner} space "}}") space')


def _members(gen: _Gen, kvs: List[Tuple[str, bool]], sep: str, need: bool) -> Optional[str]:
    """A rule for the members ``kvs`` (rule, required?) in order, optional ones left out, ``sep``
    between two; ``need``: at least one.  None: nothing to write (no members)."""
    memo: Dict[Tuple[int, bool, bool], Optional[str]] = {}

    def seq(i: int, first: bool, need_: bool) -> Optional[str]:
        if i == len(kvs):
            return None if need_ else ""
        key = (i, first, need_)
        if key not in memo:
            kv, required = kvs[i]
            this = " ".join(x for x in ("" if first else sep, kv, seq(i + 1, False, False)) if x)
            skip = None if required else seq(i + 1, first, need_)
            body = this if skip is None else (f"({this})?" if skip == "" else f"({this}) | {skip}")
            memo[key] = gen.new(body)
        return memo[key]

    return seq(0, True, need) if kvs else None


def _tool_rule(t: dict, i: int, rules: List[str]) -> str:
    name = t["function"]["name"]
    params = t["function"].get("parameters")
    if params is None or params == {}:    # llama.cpp's common_chat_tool_parameters
        params = {"type": "object", "properties": {}}
    gen = _Gen(name, params, i)
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise gen.err("its parameters schema must be an object")
    props = params.get("properties") or {}
    if not isinstance(props, dict):
        raise gen.err("'properties' is not an object")
    req = set(params.get("required") or ())
    kvs = []
    try:
        for k, v in props.items():
            if not k or k != k.strip(_CSPACE) or any(c in k for c in "=(),"):
                raise gen.err(f"the property name {k!r} cannot be written as an LFM2 argument")
            # llama-server: a "string"-typed argument is a quoted string, any other any value
            val = gen.value(v, 1, string_only=True) if isinstance(v, dict) and v.get("type") == "string" \
                else gen.value(v, 1)
            kvs.append((gen.new(f"{_g(k + '=')} {val}"), k in req))
    except RecursionError:
        raise gen.err("its parameters schema nests too deeply") from None
    except ToolSchemaError:
        raise
    except (TypeError, ValueError, AttributeError) as e:
        raise gen.err(f"unsupported parameters schema: {e}") from None
    args = _members(gen, kvs, '"," space', need=True)
    rules += gen.rules
    body = f"{_g(name + '(')} space {args} space \")\"" if args else f"{_g(name + '(')} space space \")\""
    rules.append(f"call-{i} ::= {body}")
    return f"call-{i}"


def grammar(fmt: ToolFormat, tools: Sequence[dict], choice: Any, parallel: bool,
            think: bool = True) -> Optional[ToolGrammar]:
    """:func:`.tool_grammar.tool_grammar`'s contract, for LFM2's calls (module doc)."""
    if choice == "none" or not tools:
        return None
    named = choice.get("name") if isinstance(choice, dict) else None
    use = [t for t in tools if t["function"]["name"] == named] if named else list(tools)
    rules = list(_COMMON)
    alts = []
    for i, t in enumerate(use):
        name = t["function"]["name"]
        if not name or name != name.strip(_CSPACE) or any(c in name for c in "=(),[]"):
            raise ToolSchemaError(f"tool {name!r}: the name cannot be written in an LFM2 call")
        alts.append(_tool_rule(t, i, rules))
    rules.append("call ::= " + " | ".join(alts))
    many = ' ("," space call)*' if parallel and not named else ""
    rules.append(f'calls ::= {_g(CALL_START)} "[" space call{many} space "]" {_g(CALL_END)}')
    if choice == "auto":
        rules.append("root ::= calls")
        return ToolGrammar("\n".join(rules) + "\n", True, (CALL_START,), False)
    if fmt.think and think:
        rules.append(f'root ::= ({_g(THINK_START)} think-0 [\\n]{{0,2}})? calls')
        rules.extend(until_rules("think", THINK_END))
    else:
        rules.append("root ::= calls")
    return ToolGrammar("\n".join(rules) + "\n", False)
