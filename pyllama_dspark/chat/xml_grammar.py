"""The grammar of Qwen3-Coder XML tool calls (for :mod:`.xml_calls`, the codec), as llama.cpp's
``common/parsers/qwen3-coder.cpp`` builds it::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

* a parameter whose schema admits only strings: its value is raw text up to ``\\n</parameter>\\n``
  (an ``enum`` / ``pattern`` is not enforced: llama-server's grammar does not either);
* one that admits no string: a JSON value of its schema (llama-cpp-python's converter: one optional
  space after ``{`` ``[`` ``:`` ``,``, as the templates write JSON), and no whitespace after the
  value (llama-server's grammar allows it there, but its parser and ours then drop the call);
* one that admits strings and other types: raw text, as llama-server (its parser then tries JSON
  first: :mod:`.xml_calls`);
* the required parameters first in any order, then the optional ones, any of them any number of
  times (llama-server's ``permute`` and ``zero_or_more``); a tool with more than
  :data:`MAX_PERMUTED` required parameters takes them in the schema's order;
* Qwen3-Coder (a template without ``<think>``) may leave out the first ``<tool_call>``; its
  ``auto`` triggers are ``<tool_call>`` and ``<function=NAME>`` per tool, the others' ``<tool_call>``;
* ``"required"`` / a named tool after a prompt that opened ``<think>``: the reasoning first, ended by
  ``</think>`` (then whitespace) or by the first call's ``<tool_call>`` (as llama-server's parser ends
  it); llama-server's grammar also admits content before the calls, ours does not.

A schema this cannot write (a name with ``>`` or a newline, a schema the converter refuses) is a
:class:`~.tool_grammar.ToolSchemaError` naming the tool.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

from llama_cpp.llama_grammar import SchemaConverter

from pyllama_dspark.chat.formats import ToolFormat
from pyllama_dspark.chat.tool_grammar import ToolGrammar, ToolSchemaError, calls_of, lit, until_rules, with_root

__all__ = ["grammar", "until_any", "value_types", "params_of", "MAX_PERMUTED", "CALL_OPEN", "CALL_CLOSE", "ARG_CLOSE"]

CALL_OPEN, CALL_CLOSE, ARG_CLOSE = "<tool_call>", "</tool_call>", "\n</parameter>\n"
MAX_PERMUTED = 8          # required parameters in any order up to this many (2**n grammar rules)
ALL: FrozenSet[str] = frozenset(("string", "number", "integer", "boolean", "null", "array", "object"))
_JSON_TYPES = {"string", "number", "integer", "boolean", "null", "array", "object"}


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(v), "null")


def value_types(s: Any, root: Any = None, seen: Optional[set] = None) -> FrozenSet[str]:
    """The JSON types a schema admits, as llama.cpp's ``common_chat_schema::value_types`` reads it
    (``number`` admits integers; a ``$ref`` cycle contributes nothing)."""
    seen = set() if seen is None else seen
    if s is True or s == {} or not isinstance(s, dict):
        return ALL if (s is True or s == {}) else frozenset()
    if "$ref" in s:
        ref = s["$ref"]
        if isinstance(ref, str) and "#" in ref:     # a local ref, or one the converter made absolute
            ref = ref[ref.index("#"):]
        if ref in seen or not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            return frozenset()
        node: Any = root
        for part in (ref[2:].split("/") if ref != "#" else ()):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return frozenset()
        return value_types(node, root, seen | {ref})
    if "const" in s:
        return frozenset((_json_type(s["const"]),))
    if "enum" in s and isinstance(s["enum"], list):
        return frozenset(_json_type(v) for v in s["enum"])
    for k in ("anyOf", "oneOf"):
        if isinstance(s.get(k), list):
            return frozenset().union(*(value_types(x, root, seen) for x in s[k]))
    if isinstance(s.get("allOf"), list):
        out = ALL
        for x in s["allOf"]:
            out = out & value_types(x, root, seen)
        return out
    t = s.get("type")
    ts = t if isinstance(t, list) else ([t] if t is not None else [])
    if not ts:
        if "properties" in s:
            return frozenset(("object",))
        if "items" in s:
            return frozenset(("array",))
        return ALL
    out = set()
    for x in ts:
        if x in _JSON_TYPES:
            out.add(x)
            if x == "number":
                out.add("integer")
    return frozenset(out)


def params_of(tool: dict) -> Tuple[dict, List[Tuple[str, Any, bool]]]:
    """(the parameters schema, its properties as (name, schema, required)) of a tool."""
    params = tool["function"].get("parameters")
    if params is None or params == {}:     # llama.cpp's common_chat_tool_parameters
        params = {"type": "object", "properties": {}}
    props = params.get("properties") if isinstance(params, dict) else None
    req = set(params.get("required") or ()) if isinstance(params, dict) else set()
    out = [(k, v, k in req) for k, v in props.items()] if isinstance(props, dict) else []
    return params, out


def _check_name(tool: str, name: str, what: str) -> None:
    if not name or any(c in name for c in ">\n") or name != name.strip():
        raise ToolSchemaError(f"tool {tool!r}: the {what} {name!r} cannot be written in a Qwen3-Coder XML call")


def until_any(name: str, ends: Dict[str, str]) -> List[str]:
    """Rules ``name-0`` ...: any text up to the first of the ``ends`` (text -> what follows it), then
    what follows it (an automaton over the ends' prefixes, as :func:`.tool_grammar.until_rules`)."""
    states = sorted({w[:k] for w in ends for k in range(len(w))}, key=lambda x: (len(x), x))
    sid = {w: i for i, w in enumerate(states)}
    chars = sorted({c for w in ends for c in w})

    def esc(c: str) -> str:
        return "\\" + c if c in "]\\^-" else {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c, c)

    rules = []
    for u in states:
        alts = []
        for c in chars:
            w = u + c
            if w in ends:
                alts.append(f"{lit(c)} {ends[w]}")
                continue
            while w and w not in sid:
                w = w[1:]
            alts.append(f"{lit(c)} {name}-{sid[w]}")
        alts.append("[^" + "".join(esc(c) for c in chars) + f"] {name}-0")
        rules.append(f"{name}-{sid[u]} ::= " + " | ".join(alts))
    return rules


def _args_rule(i: int, args: List[Tuple[str, bool]], rules: List[str]) -> str:
    """The arguments of tool ``i``: ``args`` (rule, required); required ones first in any order."""
    req = [r for r, q in args if q]
    opt = [r for r, q in args if not q]
    if len(req) <= MAX_PERMUTED and len(req) > 1:
        memo: Dict[Tuple[int, ...], str] = {}

        def perm(left: Tuple[int, ...]) -> str:
            if left not in memo:
                name = f"t{i}-req-" + "-".join(map(str, left))
                memo[left] = name
                alts = [" ".join(x for x in (req[k], perm(tuple(j for j in left if j != k)) if len(left) > 1 else "")
                                 if x) for k in left]
                rules.append(f"{name} ::= " + " | ".join(alts))
            return memo[left]

        head = perm(tuple(range(len(req))))
    else:
        head = " ".join(req)
    tail = "(" + " | ".join(opt) + ")*" if opt else ""
    body = " ".join(x for x in (head, tail) if x)
    rules.append(f"t{i}-args ::= {body}" if body else f't{i}-args ::= ""')
    return f"t{i}-args"


def grammar(fmt: ToolFormat, tools: Sequence[dict], choice: Any, parallel: bool,
            think: bool = True) -> Optional[ToolGrammar]:
    """:func:`.tool_grammar.tool_grammar`'s contract, for Qwen3-Coder XML calls (module doc)."""
    if (pick := calls_of(tools, choice, parallel)) is None:
        return None
    use, many = pick
    coder = fmt.think is None
    conv = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    rules: List[str] = ['xsp ::= | " " | "\\n"{1,2} [ \\t]{0,20}'] + until_rules("xstr", ARG_CLOSE)
    funcs = []
    for i, t in enumerate(use):
        name = t["function"]["name"]
        _check_name(name, name, "name")
        params, props = params_of(t)
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ToolSchemaError(f"tool {name!r}: its parameters schema must be an object")
        args = []
        try:
            root = conv.resolve_refs(copy.deepcopy(params), f"tool-{i}") if props else params
            props = [(k, root["properties"][k], r) for k, _, r in props]
            for j, (key, schema, required) in enumerate(props):
                _check_name(name, key, "parameter name")
                types = value_types(schema, root)
                if not types:
                    raise ToolSchemaError(f"tool {name!r}: parameter {key!r} admits no value")
                if "string" in types:
                    value = "xstr-0"
                else:
                    value = conv.visit(schema, f"t{i}-p{j}") + " " + lit(ARG_CLOSE)
                rules.append(f"t{i}-a{j} ::= {lit(f'<parameter={key}>' + chr(10))} {value}")
                args.append((f"t{i}-a{j}", required))
        except ToolSchemaError:
            raise
        except RecursionError:
            raise ToolSchemaError(f"tool {name!r}: its parameters schema nests too deeply") from None
        except Exception as e:   # the converter asserts / raises on what it does not support
            raise ToolSchemaError(f"tool {name!r}: unsupported parameters schema: {type(e).__name__}: {e}") from None
        a = _args_rule(i, args, rules)
        rules.append(f"func-{i} ::= {lit(f'<function={name}>' + chr(10))} {a} {lit('</function>' + chr(10))}")
        funcs.append(f"func-{i}")
    # no whitespace after a JSON value (module doc): the converter's trailing ``space`` dropped, the one
    # after "{" "[" ":" "," kept (the templates' tojson writes {"a": [1, 2]})
    rules = [r[:-len(" space")] if r.endswith(" space") and not r.startswith("space ::=") else r
             for r in conv.format_grammar().strip().splitlines() if r] + rules
    rules.append("call-body ::= (" + " | ".join(funcs) + f") {lit(CALL_CLOSE)} xsp")
    rules.append(f"tool-call ::= {lit(CALL_OPEN + chr(10))} call-body")
    first = f"({lit(CALL_OPEN + chr(10))})? call-body" if coder else "tool-call"
    rules.append(f"first-call ::= {first}")
    rules.append("calls ::= first-call" + (" tool-call*" if many else ""))
    words = (CALL_OPEN,) + (tuple(f"<function={t['function']['name']}>" for t in use) if coder else ())
    thought = None
    if fmt.think and think:      # the prompt opened a reasoning block: it ends at </think> or <tool_call>
        thought = ["root ::= xthink-0 | calls",
                   f"calls-rest ::= {lit(chr(10))} call-body" + (" tool-call*" if many else "")]
        thought += until_any("xthink", {fmt.think[1]: "xsp calls", CALL_OPEN: "calls-rest"})
    return with_root(rules, choice, words, thought)
