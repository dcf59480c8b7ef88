"""DeepSeek V3.2 / V4 "DSML" tool calls (a codec of :mod:`.tool_codecs`), as llama.cpp's
``common/parsers/deepseek.cpp`` reads and constrains them::

    <｜DSML｜function_calls>                       (V4: <｜DSML｜tool_calls>)
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

Reading a reply follows llama-server's PEG parser (lenient: a text that ends early is read as far as
it goes, so ``partial`` changes nothing) and its mapper to JSON (``common/chat-peg-parser.cpp``):

* the prompt opened ``<think>`` (``lstrip`` True): either the reasoning runs up to the calls block
  (``\\n\\n`` before it left out) and the calls follow, or it runs up to ``</think>`` and then come
  the content up to the calls block and the calls (optional under ``auto``); no ``</think>`` and no
  block: all of it is reasoning.  The prompt closed it: the content, then the calls;
* a parameter whose schema may be a string has ``string="true"`` and its raw text (JSON-escaped); any
  other ``string="false"`` and a JSON value (its schema is not checked when reading);
* the required parameters in the schema's order (whitespace between), then optional ones, any
  number, each after optional whitespace; arguments become ``{"key":value,...}`` in the order written;
* after the calls block nothing may follow: such a text (and a block that does not parse) is one
  llama-server answers with HTTP 500; here it reads as without calls (reasoning, then content).

V4 renders a run of tool results in the order of the calls (:func:`sort_tool_results`, llama.cpp's
``deepseek_v4_sort_tool_results``).
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from llama_cpp.llama_grammar import SchemaConverter

from pyllama_dspark.chat.formats import ToolFormat
from pyllama_dspark.chat.parse import Reply, ToolCall
from pyllama_dspark.chat.tool_grammar import ToolGrammar, ToolSchemaError, until_rules
from pyllama_dspark.chat.xml_grammar import until_any, params_of, value_types

__all__ = ["grammar", "parse", "WANTS_TOOLS", "V4", "sort_tool_results", "DSML", "block_open", "block_close"]

WANTS_TOOLS = True        # :func:`.tool_codecs.parser` binds the request's tools (parameter types)
DSML = "｜DSML｜"
THINK_START, THINK_END = "<think>", "</think>"
INVOKE, INVOKE_END = "<" + DSML + "invoke", "</" + DSML + "invoke>"
PARAM, PARAM_END = "<" + DSML + "parameter", "</" + DSML + "parameter>"


def block_open(fmt: ToolFormat) -> str:
    """``<｜DSML｜function_calls>`` (V3.2) or ``<｜DSML｜tool_calls>`` (V4)."""
    return fmt.call_open


def block_close(fmt: ToolFormat) -> str:
    return fmt.call_close


# the PEG evaluator: :mod:`.peg`
from pyllama_dspark.chat.peg import (CSPACE as _CSPACE, FAIL, Parser, alt as _alt, brace_depth as _brace_depth,  # noqa: E402
                                     end as _end, eps as _eps, json_value as _JSON, lit as _lit, not_ as _not,
                                     rep as _rep, rest as _rest, seq as _seq, space as _space, tag as _tag,
                                     until as _until)
# a node: (tag, start, end, children)


# (string?) per parameter: True / False from the schema, None: either (only the names known)
Params = List[Tuple[str, Optional[bool], bool]]


def _arg(key: Parser, is_str: Optional[bool]) -> Parser:
    def one(flag: bool) -> Parser:
        opener = _seq(_lit(PARAM + ' name="'), _tag("arg_name", key, True),
                      _lit(f'" string="{"true" if flag else "false"}">'))
        value = _tag("arg_string_value", _until(PARAM_END)) if flag else _tag("arg_value", _JSON)
        return _tag("arg", _seq(_tag("arg_open", opener, True), value, _tag("arg_close", _lit(PARAM_END), True)))
    return one(is_str) if is_str is not None else _alt(one(True), one(False))


def _invoke(name: Parser, params: Optional[Params]) -> Parser:
    if params is None:
        key = _until('"')
        args: Parser = _rep(_seq(_space, _arg(key, None)))
    else:
        req = [_arg(_lit(k), s) for k, s, r in params if r]
        opt = [_arg(_lit(k), s) for k, s, r in params if not r]
        parts: List[Parser] = []
        for j, a in enumerate(req):
            parts += [_space, a] if j else [a]
        if opt:
            parts.append(_rep(_seq(_space, _alt(*opt))))
        args = _seq(*parts) if parts else _eps
    head = _seq(_lit(INVOKE + ' name="'), _tag("tool_name", name, True), _lit('">\n'))
    return _tag("tool", _seq(_tag("tool_open", head, True), args, _space, _tag("tool_close", _lit(INVOKE_END), True)))


_PARSERS: Dict[Any, Parser] = {}


def _schemas(names, tools) -> Optional[Dict[str, Params]]:
    if tools:
        out: Dict[str, Params] = {}
        for t in tools:
            params, props = params_of(t)
            out[t["function"]["name"]] = [(k, "string" in value_types(v, params), r) for k, v, r in props]
        return out
    return None if names is None else {n: None for n in names}


def _root(fmt: ToolFormat, opened: bool, calls: bool, schemas: Optional[Dict[str, Optional[Params]]],
          parallel: bool = True) -> Parser:
    key = (fmt.call_open, opened, calls, json.dumps(schemas, sort_keys=True), parallel)
    if len(_PARSERS) > 256:
        _PARSERS.clear()
    if key in _PARSERS:
        return _PARSERS[key]
    fc, fc_end = block_open(fmt), block_close(fmt)
    reasoning = _rep(_seq(_lit(THINK_START), _tag("reasoning", _until(THINK_END)), _lit(THINK_END)), 0, 1) \
        if opened else _eps
    if not calls:
        root = _seq(reasoning, _tag("content", _rest), _end)
    else:
        if schemas is None:
            tool = _invoke(_until('"'), None)
        else:
            tool = _alt(*(_invoke(_lit(n), p) for n, p in schemas.items())) if schemas else (lambda s, i: (FAIL, i, []))
        block = _seq(_lit(fc), _space, tool, _rep(_seq(_space, tool)) if parallel else _eps, _space, _lit(fc_end))
        before = _seq(_not(_lit(THINK_START)), _tag("content", _until("\n\n" + fc, fc)), _space)
        plain = _seq(reasoning, before, _rep(block, 0, 1))
        if opened:
            with_tc = _seq(_lit(THINK_START), _tag("reasoning", _until("\n\n" + fc, fc, THINK_END)), _space, block)
            root = _seq(_alt(with_tc, plain), _end)
        else:
            root = _seq(plain, _end)
    _PARSERS[key] = root
    return root


# ---- the mapper (common_chat_peg_mapper::map) ---------------------------------------------------------
class _Map:
    def __init__(self, s: str):
        self.s = s
        self.content: List[str] = []
        self.reasoning: List[str] = []
        self.calls: List[ToolCall] = []
        self.n_args = 0
        self.quote = False

    def visit(self, node) -> None:
        tag, start, end, kids = node
        text = self.s[start:end]
        if tag == "reasoning":
            self.reasoning.append(text)
        elif tag == "content":
            self.content.append(text)
        elif tag == "tool_open":
            self.n_args, self.quote = 0, False
        elif tag == "tool_name":
            self.calls.append(ToolCall(text.rstrip(_CSPACE), "{", complete=False))
        elif tag == "arg_open":
            self.quote = False
        elif tag == "arg_name" and self.calls:
            self._add(("," if self.n_args else "") + json.dumps(text.strip(_CSPACE), ensure_ascii=False) + ":")
            self.n_args += 1
        elif tag == "arg_string_value" and self.calls:
            self._add(("" if self.quote else '"') + json.dumps(text, ensure_ascii=False)[1:-1])
            self.quote = True
        elif tag == "arg_value" and self.calls and text:
            self._add(text)
        elif tag == "arg_close" and self.calls and self.quote:
            self._add('"')
            self.quote = False
        elif tag == "tool_close" and self.calls:
            c = self.calls[-1]
            if self.quote:
                c.arguments += '"'
                self.quote = False
            c.arguments += "}" * max(_brace_depth(c.arguments), 0)
            c.complete = True
        for k in kids:
            self.visit(k)

    def _add(self, text: str) -> None:
        self.calls[-1].arguments += text


def parse(text: str, fmt: ToolFormat, names=None, *, partial: bool = False, lstrip: bool = True,
          calls: bool = True, tools: Optional[Sequence[dict]] = None) -> Reply:
    """:func:`.parse.parse_reply`'s contract (module doc).  ``lstrip``: the prompt opened ``<think>``
    (False: it closed it); ``partial`` changes nothing (a text so far reads as its end will);
    ``calls`` False (``tool_choice: "none"``): reasoning and content only; ``tools``: the request's
    tools (the parameter types and order); without them any parameter of the named tools is read."""
    opened = lstrip and fmt.think is not None
    s = (THINK_START if opened else "") + text
    root = _root(fmt, opened, calls, _schemas(names, tools))
    try:
        st, _, nodes = root(s, 0)
    except RecursionError:     # values nested beyond Python's stack: not read as calls
        st = FAIL
    if st == FAIL:             # llama-server's HTTP 500: read as without calls
        st, _, nodes = _root(fmt, opened, False, None)(s, 0)
    m = _Map(s)
    for n in nodes:
        m.visit(n)
    return Reply("".join(m.content), "".join(m.reasoning), m.calls)


# ---- the grammar (the parser's grammar in llama.cpp, built as common_peg builds it) -------------------
def _lit_g(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _check(tool: str, name: str, what: str) -> None:
    if not name or any(c in name for c in '"\n'):
        raise ToolSchemaError(f"tool {tool!r}: the {what} {name!r} cannot be written in a DeepSeek DSML call")


def grammar(fmt: ToolFormat, tools: Sequence[dict], choice: Any, parallel: bool,
            think: bool = True) -> Optional[ToolGrammar]:
    """:func:`.tool_grammar.tool_grammar`'s contract, for DSML calls: a string parameter is raw text
    up to ``</｜DSML｜parameter>``, any other a JSON value of its schema (no whitespace after it);
    the required parameters in the schema's order, then optional ones; ``auto``: lazy from the
    block's opening; ``required`` / a named tool after an opened ``<think>``: the reasoning first,
    ended by ``</think>`` or by the block's opening."""
    if choice == "none" or not tools:
        return None
    named = choice.get("name") if isinstance(choice, dict) else None
    use = [t for t in tools if t["function"]["name"] == named] if named else list(tools)
    fc, fc_end = block_open(fmt), block_close(fmt)
    conv = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    rules: List[str] = ['xsp ::= | " " | "\\n"{1,2} [ \\t]{0,20}'] + until_rules("dstr", PARAM_END)
    funcs = []
    for i, t in enumerate(use):
        name = t["function"]["name"]
        _check(name, name, "name")
        params, props = params_of(t)
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ToolSchemaError(f"tool {name!r}: its parameters schema must be an object")
        req, opt = [], []
        try:
            root = conv.resolve_refs(copy.deepcopy(params), f"tool-{i}") if props else params
            for j, (key, _, required) in enumerate(props):
                schema = root["properties"][key]
                _check(name, key, "parameter name")
                types = value_types(schema, root)
                if not types:
                    raise ToolSchemaError(f"tool {name!r}: parameter {key!r} admits no value")
                if "string" in types:
                    value = _lit_g(f'{PARAM} name="{key}" string="true">') + " dstr-0"
                else:
                    value = _lit_g(f'{PARAM} name="{key}" string="false">') + " " + \
                        conv.visit(schema, f"t{i}-p{j}") + " " + _lit_g(PARAM_END)
                rules.append(f"t{i}-a{j} ::= {value}")
                (req if required else opt).append(f"t{i}-a{j}")
        except ToolSchemaError:
            raise
        except RecursionError:
            raise ToolSchemaError(f"tool {name!r}: its parameters schema nests too deeply") from None
        except Exception as e:   # the converter asserts / raises on what it does not support
            raise ToolSchemaError(f"tool {name!r}: unsupported parameters schema: {type(e).__name__}: {e}") from None
        body = " xsp ".join(req)
        if opt:
            body += (" " if body else "") + "(xsp (" + " | ".join(opt) + "))*"
        rules.append(f"func-{i} ::= {_lit_g(INVOKE + f' name={chr(34)}{name}{chr(34)}>' + chr(10))} "
                     f"{body + ' ' if body else ''}xsp {_lit_g(INVOKE_END)}")
        funcs.append(f"func-{i}")
    rules = [r[:-len(" space")] if r.endswith(" space") and not r.startswith("space ::=") else r
             for r in conv.format_grammar().strip().splitlines() if r] + rules
    rules.append("tool ::= " + " | ".join(funcs))
    rest = "xsp tool" + (" (xsp tool)*" if parallel and not named else "") + f" xsp {_lit_g(fc_end)}"
    rules.append(f"calls-rest ::= {rest}")
    rules.append(f"calls ::= {_lit_g(fc)} calls-rest")
    if choice == "auto":
        rules.append("root ::= calls")
        return ToolGrammar("\n".join(rules) + "\n", True, (fc,), False)
    if fmt.think and think:      # the prompt opened a reasoning block: it ends at </think> or the block
        rules.append("root ::= dthink-0")
        rules.extend(until_any("dthink", {THINK_END: "xsp calls", fc: "calls-rest"}))
    else:
        rules.append("root ::= xsp calls")
    return ToolGrammar("\n".join(rules) + "\n", False)


# ---- V4: tool results in the order of the calls -------------------------------------------------------
def sort_tool_results(msgs: List[dict]) -> List[dict]:
    """llama.cpp's ``deepseek_v4_sort_tool_results``: in each run of user / tool messages, the tool
    results (two or more) reordered (stably) by the position of their call in the last assistant
    message with calls; a result whose id matches none sorts as the first call."""
    out = list(msgs)
    order: Dict[str, int] = {}
    i = 0
    while i < len(out):
        role = out[i].get("role", "")
        if role == "assistant" and out[i].get("tool_calls"):
            order = {c.get("id"): k for k, c in enumerate(out[i]["tool_calls"]) if c.get("id")}
            i += 1
            continue
        if role not in ("user", "tool"):
            i += 1
            continue
        j, pos = i, []
        while j < len(out) and out[j].get("role", "") in ("user", "tool"):
            if out[j].get("role") == "tool":
                pos.append(j)
            j += 1
        if len(pos) > 1 and order:
            res = sorted((out[p] for p in pos), key=lambda m: order.get(m.get("tool_call_id", ""), 0))
            for p, m in zip(pos, res):
                out[p] = m
        i = j
    return out


# DeepSeek V4 (its block named tool_calls): the same calls, tool results in the order of the calls
V4 = SimpleNamespace(grammar=grammar, parse=parse, WANTS_TOOLS=True, adjust_messages=sort_tool_results)
