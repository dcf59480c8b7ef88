"""One chat request with tools, from its OpenAI fields to what the decoder needs: the checks
(:func:`check_tools`, :func:`check_tool_choice`, :func:`check_tool_messages`; each raises a
ValueError whose message a server returns as a 400), the prompt and the grammar (:func:`plan_tools`,
:meth:`ToolPlan.compile`), and the special tokens the reply's text must show (:meth:`ToolPlan.special_ids`).

Shared by ``serve`` and the :class:`~pyllama_dspark.integrations.dspark.DSpark` class, so both give the
same calls for the same request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

from pyllama_dspark.chat import tool_codecs
from pyllama_dspark.chat.tool_prompt import ToolChat
from pyllama_dspark.chat.formats import ToolFormat, UnsupportedToolFormat
from pyllama_dspark.chat.tool_grammar import ToolGrammar, ToolSchemaError
from pyllama_dspark.chat.parse import ReplyDiffer

__all__ = ["ToolPlan", "check_tools", "check_tool_choice", "check_tool_messages", "plan_tools",
           "UnsupportedToolFormat", "ToolSchemaError"]

CHOICES = ("none", "auto", "required")


def _tn(v: Any) -> str:
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                     list: "array", dict: "object"}.get(type(v), type(v).__name__)


def check_tools(tools: Any) -> List[dict]:
    """``tools`` -> a list of ``{"type": "function", "function": {...}}`` (None: []); ValueError."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError(f"'tools' must be an array, got {_tn(tools)}")
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise ValueError(f"{where} must be an object, got {_tn(t)}")
        if t.get("type") != "function":
            raise ValueError(f"{where}.type must be \"function\" (the only tool type), got {t.get('type')!r}")
        f = t.get("function")
        if not isinstance(f, dict):
            raise ValueError(f"{where}.function must be an object, got {_tn(f)}")
        name = f.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name must be a non-empty string")
        if name in seen:
            raise ValueError(f"{where}.function.name {name!r} is given twice")
        seen.add(name)
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise ValueError(f"{where}.function.description must be a string")
        params = f.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise ValueError(f"{where}.function.parameters must be a JSON schema object, got {_tn(params)}")
            _check_schema(params, f"{where}.function.parameters")
        fn: Dict[str, Any] = {"name": name}
        if f.get("description") is not None:
            fn["description"] = f["description"]
        if params is not None:
            fn["parameters"] = params
        out.append({"type": "function", "function": fn})
    return out


def _check_schema(schema: dict, where: str) -> None:
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - a dependency of the server extra
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        raise ValueError(f"{where} is not a valid JSON schema: {e.message}") from None


def check_tool_choice(choice: Any, tools: Sequence[dict]) -> Union[str, dict]:
    """``tool_choice`` -> "none" | "auto" | "required" | {"name": ...}; ValueError."""
    if choice is None:
        return "auto"
    names = [t["function"]["name"] for t in tools]
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ValueError(f"'tool_choice' must be one of {', '.join(CHOICES)} or a function, got {choice!r}")
        if choice == "required" and not tools:
            raise ValueError("'tool_choice' \"required\" needs 'tools'")
        return choice
    if isinstance(choice, dict):
        f = choice.get("function")
        name = f.get("name") if isinstance(f, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError("'tool_choice' as an object must be "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name not in names:
            raise ValueError(f"'tool_choice' names the function {name!r}, which is not in 'tools'")
        return {"name": name}
    raise ValueError(f"'tool_choice' must be a string or an object, got {_tn(choice)}")


def check_tool_messages(messages: Sequence[dict]) -> None:
    """Assistant ``tool_calls`` (function name, arguments as a JSON object or its text, id) and
    ``tool`` results (a ``tool_call_id`` of an earlier call); ValueError."""
    ids: set = set()
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is not None:
            if m.get("role") != "assistant":
                raise ValueError(f"messages[{i}]: only assistant messages carry tool_calls")
            if not isinstance(calls, list):
                raise ValueError(f"messages[{i}].tool_calls must be an array")
            for j, c in enumerate(calls):
                where = f"messages[{i}].tool_calls[{j}]"
                f = c.get("function") if isinstance(c, dict) else None
                if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
                    raise ValueError(f"{where} must be "
                                     "{\"type\": \"function\", \"function\": {\"name\", \"arguments\"}}")
                a = f.get("arguments")
                if isinstance(a, str):
                    try:
                        a = json.loads(a)
                    except ValueError as e:
                        raise ValueError(f"{where}.function.arguments is not JSON ({e}): "
                                         f"{f['arguments'][:80]!r}") from None
                if not isinstance(a, dict):
                    raise ValueError(f"{where}.function.arguments must be a JSON object (or its text), got {_tn(a)}")
                cid = c.get("id")
                if cid is not None:
                    if not isinstance(cid, str):
                        raise ValueError(f"{where}.id must be a string")
                    ids.add(cid)
        if m.get("role") == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str):
                raise ValueError(f"messages[{i}]: a tool message needs 'tool_call_id' (a string)")
            if cid not in ids:
                raise ValueError(f"messages[{i}].tool_call_id {cid!r} matches no earlier assistant tool call")


@dataclass
class ToolPlan:
    """A request's prompt text and grammar (module doc)."""
    fmt: Optional[ToolFormat]            # None: a template without a format and no tools in use
    prompt: str
    added_special: bool
    grammar: Optional[ToolGrammar]
    names: List[str] = field(default_factory=list)
    choice: Union[str, dict] = "auto"
    parallel: bool = True
    think_closed: bool = False           # the prompt ends after a closed reasoning block
    tools: List[dict] = field(default_factory=list)   # the request's tools (a codec's parser may read them)

    @property
    def lstrip(self) -> bool:
        """Whether the reply's leading whitespace is skipped when parsed (:func:`~.parse.parse_reply`)."""
        return not self.think_closed

    @property
    def parses(self) -> bool:
        """The reply is parsed (tools given): for calls, or under tool_choice "none" for its
        reasoning and content only, as llama-server parses it."""
        return self.fmt is not None and bool(self.names)

    def compile(self, target):
        """What the decoder takes as its grammar: GBNF text (strict), a
        :class:`~pyllama_dspark.llama.grammar_lazy.LazyGrammar` (auto; the caller owns it) or None.  A trigger word that is
        one token of the vocabulary triggers on that token only, as llama-server makes it a token
        trigger."""
        g = self.grammar
        if g is None:
            return None
        if not g.lazy:
            return g.gbnf
        from pyllama_dspark.llama.grammar_lazy import LazyGrammar

        words, tokens = [], []
        for w in g.words:
            ids = target.tokenize(w, False, True)
            if len(ids) == 1 and not g.at_start:
                tokens.append(ids[0])
            else:
                words.append(w)
        return LazyGrammar.compile(g.gbnf, target, words=words, tokens=tokens, at_start=g.at_start,
                                   think=self.fmt.think)

    def differ(self) -> Optional[ReplyDiffer]:
        """The reply's parser as a stream of deltas (None: the reply is not parsed)."""
        if not self.parses:
            return None
        return ReplyDiffer(self.fmt, self.names, self.lstrip,
                           parse=tool_codecs.parser(self.fmt, calls=self.choice != "none", tools=self.tools,
                                                    prompt=self.prompt))

    def special_ids(self, target) -> List[int]:
        """Tokens of the format's markers, rendered in the reply's text even when they are control
        tokens (llama-server's preserved tokens)."""
        f = self.fmt
        if f is None:
            return []
        out: set = set()
        for text in (f.call_open, f.call_close, f.section_open) + (f.think or ()) + f.markers:
            if text.strip():
                out.update(target.tokenize(text.strip(), False, True))
        return sorted(out)


def plan_tools(chat: ToolChat, messages: Sequence[dict], tools: Sequence[dict], choice: Union[str, dict],
               parallel: Optional[bool] = None, template_kwargs: Optional[Dict[str, Any]] = None) -> ToolPlan:
    """Prompt and grammar of a checked request; UnsupportedToolFormat / ToolSchemaError / ValueError."""
    fmt = chat.check() if tools else chat.format
    if parallel is None:   # llama-server's default: what the template can render
        parallel = chat.caps.supports_parallel_tool_calls or (fmt is not None and fmt.system_tools)
    r = chat.render(messages, tools, template_kwargs=template_kwargs, adjust=tool_codecs.adjust_messages(fmt))
    fix = tool_codecs.adjust_prompt(fmt)
    if fix is not None:
        r.prompt = fix(r.prompt)
    closed = fmt is not None and fmt.think is not None and r.prompt.rstrip().endswith(fmt.think[1])
    grammar = tool_codecs.grammar(fmt, tools, choice, bool(parallel), not closed, prompt=r.prompt) \
        if fmt is not None and tools else None
    return ToolPlan(fmt, r.prompt, r.added_special, grammar, [t["function"]["name"] for t in tools], choice,
                    bool(parallel), closed, list(tools))
