"""DeepSeek V3.1 tool calls (a codec of :mod:`.tool_codecs`), as llama.cpp's differential
"autoparser" (``common/chat-auto-parser-generator.cpp``, its ``TAG_WITH_JSON`` mode) reads and
constrains them on the vendored ``deepseek-ai-DeepSeek-V3.1.jinja``::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The template renders no tool list (llama-server warns "Template supports tool calls but does not
natively describe tools" and sends the prompt as it is); we send the same prompt.

Reading a reply follows llama-server's parser (lenient: a text that ends early reads as far as it
goes) and its mapper (``common/chat-peg-parser.cpp``).  The parser reads the generation prompt's
tail before the reply (:func:`opening`: ``<think>`` when thinking is on, ``<think></think>`` when
off, nothing after a tool result, where the template opens no assistant turn):

* leading whitespace, then an optional ``<think>`` ... ``</think>`` block (reasoning; a block of
  whitespace only reads as none), then content up to ``<｜tool▁calls▁begin｜>``, then the calls;
* each call ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>`` (whitespace) a JSON value ``<｜tool▁call▁end｜>``
  (whitespace between calls and around the block); the arguments are the JSON text as written;
* nothing may follow the block: such a text (and a block that does not parse) is one llama-server
  answers with HTTP 500; here it reads as without calls.
"""

from __future__ import annotations

import copy
from typing import Any, List, Optional, Sequence

from llama_cpp.llama_grammar import SchemaConverter

from pyllama_dspark.chat.formats import ToolFormat
from pyllama_dspark.chat.parse import Reply, ToolCall
from pyllama_dspark.chat.peg import (CSPACE, FAIL, Parser, alt, brace_depth, end, json_value, lit, rep, rest,
                                     seq, space, tag, until)
from pyllama_dspark.chat.tool_grammar import ToolGrammar, ToolSchemaError, calls_of, lit as glit, until_rules

__all__ = ["grammar", "parse", "opening", "WANTS_TOOLS", "WANTS_PROMPT", "CALLS_BEGIN", "CALLS_END", "CALL_BEGIN",
           "CALL_END", "SEP"]

WANTS_TOOLS = True        # :func:`.tool_codecs.parser` binds the request's tools (their names)
WANTS_PROMPT = True       # ... and the prompt (:func:`opening`)
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
THINK, THINK_END = "<think>", "</think>"


def opening(prompt: Optional[str], lstrip: bool = True) -> str:
    """The tail of the generation prompt the parser reads before the reply: ``<think>`` (thinking on),
    ``<think></think>`` (off), or nothing (after a tool result the template opens no turn); without
    the prompt, ``lstrip`` says whether it opened ``<think>``."""
    if prompt is None:
        return THINK if lstrip else THINK + THINK_END
    if prompt.endswith(THINK + THINK_END):
        return THINK + THINK_END
    return THINK if prompt.endswith(THINK) else ""


def _call(name: Parser) -> Parser:
    head = tag("tool_open", seq(tag("tool_name", name, True), lit(SEP)), True)
    return seq(lit(CALL_BEGIN), head, space, tag("tool_args", json_value),
               tag("tool_close", lambda s, i: (lit(CALL_END)(s, i)[0], i, []), True), lit(CALL_END))


def _root(calls: bool, names: Optional[Sequence[str]]) -> Parser:
    reasoning = rep(seq(lit(THINK), tag("reasoning", until(THINK_END)), lit(THINK_END)), 0, 1)
    if not calls:
        return seq(space, reasoning, tag("content", rest), end)
    if names is None:
        one = _call(until(SEP))
    else:
        one = alt(*(_call(lit(n)) for n in names)) if names else (lambda s, i: (FAIL, i, []))
    block = seq(lit(CALLS_BEGIN), space, one, rep(seq(space, one)), space, lit(CALLS_END))
    return seq(space, reasoning, rep(tag("content", until(CALLS_BEGIN)), 0, 1), rep(block, 0, 1), end)


def _map(s: str, nodes) -> Reply:
    content: List[str] = []
    reasoning: List[str] = []
    calls: List[ToolCall] = []

    def visit(node) -> None:
        kind, start, stop, kids = node
        text = s[start:stop]
        if kind == "reasoning":
            reasoning.append(text)
        elif kind == "content":
            content.append(text)
        elif kind == "tool_name":
            calls.append(ToolCall(text.rstrip(CSPACE), "{", complete=False))
        elif kind == "tool_args" and calls:
            t = text.rstrip(CSPACE)
            if t.startswith("{"):
                calls[-1].arguments = t
        elif kind == "tool_close" and calls:
            calls[-1].arguments += "}" * max(brace_depth(calls[-1].arguments), 0)
            calls[-1].complete = True
        for k in kids:
            visit(k)

    for n in nodes:
        visit(n)
    think = "".join(reasoning)
    return Reply("".join(content), "" if not think.strip(" \n\r\t") else think, calls)


def parse(text: str, fmt: ToolFormat, names=None, *, partial: bool = False, lstrip: bool = True,
          calls: bool = True, tools: Optional[Sequence[dict]] = None, prompt: Optional[str] = None) -> Reply:
    """:func:`.parse.parse_reply`'s contract (module doc).  ``prompt``: the prompt the reply follows
    (:func:`opening`; without it ``lstrip`` says whether it opened ``<think>``); ``partial`` changes
    nothing; ``calls`` False (``tool_choice: "none"``): reasoning and content only; ``tools``: the
    request's tools (their names; else ``names``, else any name)."""
    s = opening(prompt, lstrip) + text
    if tools:
        names = [t["function"]["name"] for t in tools]
    try:
        st, _, nodes = _root(calls, names)(s, 0)
    except RecursionError:     # values nested beyond Python's stack: not read as calls
        st = FAIL
    if st == FAIL:             # llama-server's HTTP 500: read as without calls
        st, _, nodes = _root(False, None)(s, 0)
    return _map(s, nodes)


# ---- the grammar --------------------------------------------------------------------------------------
def grammar(fmt: ToolFormat, tools: Sequence[dict], choice: Any, parallel: bool, think: bool = True,
            prompt: Optional[str] = None) -> Optional[ToolGrammar]:
    """:func:`.tool_grammar.tool_grammar`'s contract: each call's arguments one JSON object of the
    tool's schema (llama-cpp-python's converter; no whitespace after it), whitespace where
    llama-server's grammar has it; ``auto``: lazy from ``<｜tool▁calls▁begin｜>``; ``required`` / a
    named tool: after the reasoning the prompt opened (ended by ``</think>``), or, after a tool
    result, an optional reasoning block, then the calls."""
    if (pick := calls_of(tools, choice, parallel)) is None:
        return None
    use, many = pick
    conv = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    rules: List[str] = ['xsp ::= | " " | "\\n"{1,2} [ \\t]{0,20}']
    funcs = []
    for i, t in enumerate(use):
        name = t["function"]["name"]
        if not name or SEP in name or any(c in name for c in CSPACE):
            raise ToolSchemaError(f"tool {name!r}: the name cannot be written in a DeepSeek V3.1 call")
        params = t["function"].get("parameters")
        if params is None or params == {}:      # llama.cpp's common_chat_tool_parameters
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ToolSchemaError(f"tool {name!r}: its parameters schema must be an object")
        try:
            args = conv.visit(conv.resolve_refs(copy.deepcopy(params), f"tool-{i}"), f"t{i}-args")
        except RecursionError:
            raise ToolSchemaError(f"tool {name!r}: its parameters schema nests too deeply") from None
        except Exception as e:   # the converter asserts / raises on what it does not support
            raise ToolSchemaError(f"tool {name!r}: unsupported parameters schema: {type(e).__name__}: {e}") from None
        rules.append(f"func-{i} ::= {glit(name + SEP)} xsp {args}")
        funcs.append(f"func-{i}")
    # llama-server's JSON has no whitespace after a value: the converter's trailing `space` goes
    rules = [r[:-len(" space")] if r.endswith(" space") and not r.startswith("space ::=") else r
             for r in conv.format_grammar().strip().splitlines() if r] + rules
    rules.append(f"one ::= {glit(CALL_BEGIN)} ({' | '.join(funcs)}) {glit(CALL_END)}")
    rules.append("calls-rest ::= xsp one" + (" (xsp one)*" if many else "") + f" xsp {glit(CALLS_END)}")
    rules.append(f"calls ::= {glit(CALLS_BEGIN)} calls-rest")
    if choice == "auto":
        return ToolGrammar("\n".join(rules + ["root ::= calls"]) + "\n", True, (CALLS_BEGIN,), False)
    tail = opening(prompt, think)
    if tail == THINK:               # the prompt opened the reasoning: it ends at </think>
        rules += ["root ::= think-0 xsp calls"] + until_rules("think", THINK_END)
    elif tail == "":                # no turn opened (after a tool result): a reasoning block may come first
        rules += [f"root ::= xsp ({glit(THINK)} think-0 xsp)? calls"] + until_rules("think", THINK_END)
    else:
        rules.append("root ::= xsp calls")
    return ToolGrammar("\n".join(rules) + "\n", False)

