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
from typing import Any, List, Optional, Sequence

from pyllama_dspark.chat.formats import ToolFormat
from pyllama_dspark.chat.schema_gbnf import SchemaWalker
from pyllama_dspark.chat.tool_grammar import ToolGrammar, ToolSchemaError, calls_of, lit, think_root, with_root

__all__ = ["grammar", "CALL_START", "CALL_END", "THINK_START", "THINK_END"]

CALL_START, CALL_END = "<|tool_call_start|>", "<|tool_call_end|>"
THINK_START, THINK_END = "<think>", "</think>"
_CSPACE = " \t\n\r\v\f"      # C isspace


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


def _quoted(v: str) -> List[str]:
    """A string constant as the model may write it: in double or in single quotes."""
    inner = json.dumps(v, ensure_ascii=False)[1:-1]
    return ['"' + inner + '"', "'" + inner.replace('\\"', '"').replace("'", "\\'") + "'"]


class _Gen(SchemaWalker):
    """JSON schema -> GBNF rules for values in the Python-ish syntax of LFM2's calls."""

    ANY, ANY_DICT, NULL = "lf-val", "lf-dict", "lf-null"
    SIMPLE = {"string": "lf-str", "number": "lf-num", "integer": "lf-int", "boolean": "lf-bool", "null": "lf-null"}
    END = " space"              # a container value ends with space (as llama-server's lf-dict / lf-arr)
    SEP = 'space "," space'

    def literal(self, v: Any) -> List[str]:
        if isinstance(v, str):
            return [lit(x) for x in _quoted(v)]
        if isinstance(v, bool):
            return [lit("True" if v else "False"), lit("true" if v else "false")]
        if v is None:
            return ['"None"', '"null"']
        if isinstance(v, (int, float)):
            return [lit(json.dumps(v))]
        if isinstance(v, (list, dict)):    # written as JSON text, as a container value ends: with space
            return [lit(json.dumps(v, ensure_ascii=False, separators=(",", ":"))) + " space"]
        raise self.err(f"unsupported value {v!r}")

    def key(self, k: str) -> str:
        return "(" + " | ".join(lit(q) for q in _quoted(k)) + ') space ":"'


def _tool_rule(t: dict, i: int, rules: List[str]) -> str:
    gen = _Gen.for_tool(t, i)
    name, params = gen.tool, gen.root
    props = params.get("properties") or {}
    if not isinstance(props, dict):
        raise gen.err("'properties' is not an object")
    req = set(params.get("required") or ())
    kvs = []
    with gen.guarded():
        for k, v in props.items():
            if not k or k != k.strip(_CSPACE) or any(c in k for c in "=(),"):
                raise gen.err(f"the property name {k!r} cannot be written as an LFM2 argument")
            # llama-server: a "string"-typed argument is a quoted string, any other any value
            val = gen.value(v, 1, string_only=True) if isinstance(v, dict) and v.get("type") == "string" \
                else gen.value(v, 1)
            kvs.append((gen.new(f"{lit(k + '=')} {val}"), k in req))
    args = gen.members(kvs, '"," space', need=True)
    rules += gen.rules
    body = f"{lit(name + '(')} space {args} space \")\"" if args else f"{lit(name + '(')} space space \")\""
    rules.append(f"call-{i} ::= {body}")
    return f"call-{i}"


def grammar(fmt: ToolFormat, tools: Sequence[dict], choice: Any, parallel: bool,
            think: bool = True) -> Optional[ToolGrammar]:
    """:func:`.tool_grammar.tool_grammar`'s contract, for LFM2's calls (module doc)."""
    if (pick := calls_of(tools, choice, parallel)) is None:
        return None
    use, many = pick
    rules = list(_COMMON)
    alts = []
    for i, t in enumerate(use):
        name = t["function"]["name"]
        if not name or name != name.strip(_CSPACE) or any(c in name for c in "=(),[]"):
            raise ToolSchemaError(f"tool {name!r}: the name cannot be written in an LFM2 call")
        alts.append(_tool_rule(t, i, rules))
    rules.append("call ::= " + " | ".join(alts))
    more = ' ("," space call)*' if many else ""
    rules.append(f'calls ::= {lit(CALL_START)} "[" space call{more} space "]" {lit(CALL_END)}')
    return with_root(rules, choice, (CALL_START,), think_root(THINK_START, THINK_END) if fmt.think and think else None)
