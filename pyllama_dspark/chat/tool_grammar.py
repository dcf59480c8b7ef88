"""GBNF for a request's tool calls, in the format of its chat template (:mod:`.formats`).

Each call is one JSON object, ``{"name": <const>, "<args_key>": <the tool's parameters schema>}``
(plus an optional ``"id"`` for Mistral), converted by llama-cpp-python's JSON-schema converter
(``llama_cpp.llama_grammar.SchemaConverter``: one converter for all the tools, so their rules share
``space`` / ``string`` / ...).  Around the calls, the format's own text, as its template renders it
(``<tool_call>\\n`` ... ``\\n</tool_call>``, ``[TOOL_CALLS][`` ... ``]``).  llama-server builds the
same calls with its C++ converter (``common/chat-auto-parser-generator.cpp``); the two converters
differ in whitespace (docs/serve.md "Tools"): llama-cpp-python's allows one optional space after a
JSON token, llama-server's newlines and indentation before them.

``tool_choice``:

* ``"required"``: the reply is the calls and nothing else (a template with ``<think>`` may think
  first).  llama-server's grammar here also admits any text before the first call, so a model that
  does not start a call itself writes plain text until ``max_tokens``; ours cannot;
* a named function (``{"type": "function", "function": {"name": ...}}``): one call of that tool;
* ``"auto"``: the same calls under a lazy grammar (:class:`~pyllama_dspark.llama.grammar_lazy.LazyGrammar`) that starts
  at the format's trigger (``<tool_call>\\n``, ``[TOOL_CALLS]``, a reply that starts ``{"name"``);
* ``"none"``: no grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from llama_cpp.llama_grammar import SchemaConverter

from pyllama_dspark.chat.formats import ToolFormat

__all__ = ["ToolGrammar", "ToolSchemaError", "tool_grammar", "until_rules", "lit", "calls_of", "think_root",
           "with_root"]


class ToolSchemaError(ValueError):
    """A tool's parameters schema the converter cannot turn into a grammar."""


@dataclass(frozen=True)
class ToolGrammar:
    gbnf: str
    lazy: bool                      # auto: constrain from the trigger on
    words: tuple = ()               # trigger texts (lazy)
    at_start: bool = False          # ... only at the start of the reply


def lit(s: str) -> str:
    """``s`` as a GBNF string literal."""
    return json.dumps(s, ensure_ascii=False)


def until_rules(name: str, stop: str) -> List[str]:
    """Rules ``name-0`` ... matching any text up to and including the first ``stop`` (a KMP
    automaton over the characters of ``stop``; every other character goes back to state 0)."""
    n = len(stop)
    fail = [0] * n
    k = 0
    for i in range(1, n):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    chars = sorted(set(stop))

    def step(state: int, c: str) -> int:
        while state and stop[state] != c:
            state = fail[state - 1]
        return state + 1 if stop[state] == c else 0

    def cls_escape(c: str) -> str:
        return "\\" + c if c in "]\\^-" else {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c, c)

    rules = []
    other = "[^" + "".join(cls_escape(c) for c in chars) + "]"
    for s in range(n):
        alts = []
        for c in chars:
            t = step(s, c)
            alts.append(lit(c) if t == n else f"{lit(c)} {name}-{t}")
        alts.append(f"{other} {name}-0")
        rules.append(f"{name}-{s} ::= " + " | ".join(alts))
    return rules


def calls_of(tools: Sequence[dict], choice: Any, parallel: bool) -> Optional[Tuple[List[dict], bool]]:
    """The tools a request's calls may name (the one ``choice`` names, else all) and whether several
    calls may come (``parallel`` and no named tool); None: no grammar (``"none"``, or no tools)."""
    if choice == "none" or not tools:
        return None
    named = choice.get("name") if isinstance(choice, dict) else None
    use = [t for t in tools if t["function"]["name"] == named] if named else list(tools)
    return use, bool(parallel and not named)


def think_root(open_: str, close: str) -> List[str]:
    """The root of calls that may come after a reasoning block ``open_`` ... ``close`` (then up to
    two newlines), and its rules."""
    return [f'root ::= ({lit(open_)} think-0 [\\n]{{0,2}})? calls'] + until_rules("think", close)


def with_root(rules: List[str], choice: Any, words: Sequence[str], think: Optional[List[str]] = None,
              at_start: bool = False) -> ToolGrammar:
    """The grammar of the calls' ``rules`` (a ``calls`` rule among them): for ``choice`` "auto" a lazy
    one that starts at one of ``words`` (``at_start``: only at the start of the reply); otherwise the
    calls, after what ``think`` says where given (rules with their own root: :func:`think_root`)."""
    if choice == "auto":
        return ToolGrammar("\n".join(rules + ["root ::= calls"]) + "\n", True, tuple(words), at_start)
    return ToolGrammar("\n".join(rules + (think or ["root ::= calls"])) + "\n", False)


def _call_schema(fmt: ToolFormat, tool: dict) -> dict:
    f = tool["function"]
    params = f.get("parameters")
    if params is None or params == {}:   # llama.cpp's common_chat_tool_parameters
        params = {"type": "object", "properties": {}}
    props: dict = {"name": {"const": f["name"]}, fmt.args_key: params}
    if fmt.id_key:
        props[fmt.id_key] = {"type": "string", "pattern": fmt.id_pattern}
    schema = {"type": "object", "properties": props, "required": ["name", fmt.args_key], "additionalProperties": False}
    if isinstance(params, dict):   # a parameters schema's own definitions, where its "#/..." refs look
        for key in ("$defs", "definitions"):
            if key in params:
                schema[key] = params[key]
    return schema


def tool_grammar(fmt: ToolFormat, tools: Sequence[dict], choice: Any, parallel: bool,
                 think: bool = True) -> Optional[ToolGrammar]:
    """The grammar of a request (``choice``: "none" | "auto" | "required" | a function name as a
    ``{"name": ...}`` dict), None for "none"; ``think``: a reasoning block may open the reply (not
    when the prompt already closed one, as Qwen3's ``enable_thinking: false`` does);
    :class:`ToolSchemaError` for a schema the converter cannot do (the message names the tool)."""
    if (pick := calls_of(tools, choice, parallel)) is None:
        return None
    use, many = pick
    conv = SchemaConverter(prop_order={"name": 0, fmt.args_key: 1, (fmt.id_key or "id"): 2}, allow_fetch=False,
                           dotall=False, raw_pattern=False)
    names = []
    for i, t in enumerate(use):
        try:
            schema = conv.resolve_refs(_call_schema(fmt, t), f"tool-{i}")
            names.append(conv.visit(schema, f"call-{i}"))
        except RecursionError:
            raise ToolSchemaError(f"tool {t['function']['name']!r}: its parameters schema nests too deeply") from None
        except Exception as e:   # the converter asserts / raises on what it does not support
            raise ToolSchemaError(f"tool {t['function']['name']!r}: unsupported parameters schema: "
                                  f"{type(e).__name__}: {e}") from None
    rules = [conv.format_grammar().strip()]
    rules.append("call ::= " + " | ".join(names))
    if fmt.array:
        items = '"[" space call ("," space call)* "]" space' if many else '"[" space call "]" space'
        rules.append(f"calls ::= {lit(fmt.section_open)} {items}")
    else:
        one = " ".join(x for x in (lit(fmt.call_open) if fmt.call_open else "", "call",
                                   lit(fmt.call_close) if fmt.call_close else "") if x)
        rules.append(f"one-call ::= {one}")
        sep = lit(fmt.call_sep) + " " if fmt.call_sep else ""
        rules.append("calls ::= one-call" + (f" ({sep}one-call)*" if many else ""))
    if choice == "auto" and not fmt.trigger:
        return None
    return with_root(rules, choice, (fmt.trigger,), think_root(*fmt.think) if fmt.think and think else None,
                     fmt.trigger_at_start)
