"""A reply's text -> content, reasoning and tool calls, as llama-server's chat parser splits it.

llama-server (``--jinja``) parses every reply of a request with tools through the PEG parser of the
template's format (``common/chat-peg-parser.cpp``): the text before the first call is ``content``, a
leading ``<think>`` block is ``reasoning_content`` (whitespace-only reasoning dropped), each call's
arguments are the raw JSON text the model wrote (trailing whitespace trimmed), and streaming sends the
difference between successive parses of the text so far (``common_chat_msg_diff::compute_diffs``).
:func:`parse_reply` does the same for the formats of :mod:`.formats`; :class:`ReplyDiffer`
turns successive partial parses into OpenAI ``delta`` objects.

Where llama-server answers a reply that does not parse with an HTTP 500 ("The model produced output
that does not match the expected ... format"), the whole text is returned as content instead (this
only happens where no grammar ran: ``tool_choice: "none"``, or an ``auto`` reply that never
triggered).
"""

from __future__ import annotations

import codecs
import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from pyllama_dspark.chat.formats import ToolFormat

__all__ = ["ToolCall", "Reply", "parse_reply", "ReplyDiffer", "ReplyText", "new_call_id", "message_json",
           "whole_if_empty"]

_DEC = json.JSONDecoder()
_WS = " \t\n\r"
_ALNUM = string.ascii_letters + string.digits


def new_call_id(fmt: Optional[ToolFormat]) -> str:
    """A call id: 9 alphanumerics where the template checks them (Mistral), else llama-server's 32."""
    n = 9 if fmt is not None and fmt.id_key else 32
    return "".join(secrets.choice(_ALNUM) for _ in range(n))


@dataclass
class ToolCall:
    name: str
    arguments: str            # the JSON text as written (partial while streaming)
    id: str = ""              # the model's own (Mistral), else drawn by ReplyDiffer
    complete: bool = True     # the call's JSON object is closed


@dataclass
class Reply:
    content: str = ""
    reasoning: str = ""
    calls: List[ToolCall] = field(default_factory=list)


def _skip_ws(s: str, i: int, space: str = _WS) -> int:
    while i < len(s) and s[i] in space:
        i += 1
    return i


def _esc(s: str) -> str:
    """``s`` JSON-escaped (a JSON string's inside)."""
    return json.dumps(s, ensure_ascii=False)[1:-1]


class _Cut(Exception):
    """(The codecs' readers) the text ends inside what is being read: what was built so far stands,
    as llama.cpp's lenient parse."""


class _Bad(Exception):
    """(The codecs' readers) not the syntax expected here."""


class _Incomplete(Exception):
    """The text ends inside the construct being read."""


def _scan_object(s: str, i: int) -> Tuple[Dict[str, Tuple[int, Optional[int]]], Dict[str, object], int]:
    """Read the JSON object at ``s[i]`` key by key: (key -> value span (end None: cut off), key ->
    decoded value for complete ones, index after the object).  _Incomplete when the text ends first
    (the spans read so far are in its args), ValueError when it is not JSON."""
    if i >= len(s):
        raise _Incomplete({}, {})
    if s[i] != "{":
        raise ValueError("not an object")
    spans: Dict[str, Tuple[int, Optional[int]]] = {}
    vals: Dict[str, object] = {}
    i = _skip_ws(s, i + 1)
    if i < len(s) and s[i] == "}":
        return spans, vals, i + 1
    while True:
        if i >= len(s):
            raise _Incomplete(spans, vals)
        try:
            key, i = _DEC.raw_decode(s, i)
        except ValueError:
            if s[i] == '"' and '"' not in s[i + 1:].replace('\\"', ""):
                raise _Incomplete(spans, vals) from None
            raise
        if not isinstance(key, str):
            raise ValueError("object key is not a string")
        i = _skip_ws(s, i)
        if i >= len(s):
            raise _Incomplete(spans, vals)
        if s[i] != ":":
            raise ValueError("expected ':'")
        i = _skip_ws(s, i + 1)
        if i >= len(s):
            raise _Incomplete(spans, vals)
        start = i
        try:
            val, i = _DEC.raw_decode(s, i)
        except ValueError:
            spans[key] = (start, None)
            raise _Incomplete(spans, vals) from None
        spans[key], vals[key] = (start, i), val
        i = _skip_ws(s, i)
        if i >= len(s):
            raise _Incomplete(spans, vals)
        if s[i] == "}":
            return spans, vals, i + 1
        if s[i] != ",":
            raise ValueError("expected ',' or '}'")
        i = _skip_ws(s, i + 1)
        if i < len(s) and s[i] == "}":     # a trailing comma: llama-server's Mistral grammar makes the
            return spans, vals, i + 1      # comma before its optional "id" compulsory


def _call_from(s: str, i: int, fmt: ToolFormat, names: Optional[set], partial: bool):
    """(ToolCall or None (no name yet), index after it, complete?) for the call object at s[i]."""
    try:
        spans, vals, end = _scan_object(s, i)
        done = True
    except _Incomplete as e:
        if not partial:
            raise ValueError("the reply ends inside a tool call") from None
        spans, vals = e.args if e.args else ({}, {})
        end, done = len(s), False
    name = vals.get("name")
    if name is None:
        if done:
            raise ValueError("a tool call without a name")
        return None, end, False
    if not isinstance(name, str) or (names is not None and name not in names):
        raise ValueError(f"unknown tool {name!r}")
    span = spans.get(fmt.args_key)
    if span is None:
        if done:
            raise ValueError(f"a tool call without {fmt.args_key!r}")
        return None, end, False   # reported once its arguments start (fewer calls to take back)
    a0, a1 = span
    args = s[a0:a1] if a1 is not None else s[a0:].rstrip(_WS)
    if a1 is not None and not isinstance(vals.get(fmt.args_key), dict):
        raise ValueError("tool call arguments are not a JSON object")
    cid = vals.get(fmt.id_key) if fmt.id_key else None
    return ToolCall(name, args, cid if isinstance(cid, str) else "", done), end, done


def _split_reasoning(text: str, fmt: ToolFormat, partial: bool = False) -> Tuple[str, str]:
    """(reasoning, the rest) as llama.cpp's reasoning parser reads a leading block: the tags' own
    newlines (``<think>\n`` ... ``\n</think>\n\n``) are optional and not part of either side."""
    if not fmt.think:
        return "", text
    open_, close = fmt.think
    if not text.startswith(open_):
        if partial and text and open_.startswith(text):
            return "", ""     # maybe the start of the tag: nothing to show yet
        return "", text
    i = len(open_) + (1 if text.startswith("\n", len(open_)) else 0)
    j = text.find(close, i)
    if j < 0:
        if not partial:
            return text[i:], ""
        held = _held_back(text[i:], close)
        return (held[:-1] if held.endswith("\n") else held), ""   # the newline may belong to the tag
    inner = text[i:j]
    rest = text[j + len(close):]
    for _ in range(2):
        rest = rest[1:] if rest.startswith("\n") else rest
    return (inner[:-1] if inner.endswith("\n") else inner), rest


def _held_back(content: str, marker: str) -> str:
    """Content without a tail that may be the start of ``marker`` (streaming)."""
    for k in range(min(len(marker) - 1, len(content)), 0, -1):
        if marker.startswith(content[-k:]):
            return content[:-k]
    return content


def parse_reply(text: str, fmt: ToolFormat, names: Optional[Iterable[str]] = None, *, partial: bool = False,
                lstrip: bool = True, calls: bool = True) -> Reply:
    """Split a reply (module doc); ``names``: the request's tools (a call of another name is not a
    call); ``partial``: the text so far of a streaming reply (no error at a cut-off call);
    ``lstrip``: leading whitespace is not content (llama.cpp's parser skips the space after the
    generation prompt, except after a reasoning block the prompt already closed, and then a
    ``<think>`` in the reply is content, as in llama.cpp's parser); ``calls`` False
    (``tool_choice: "none"``): reasoning and content only, a call written as text stays content, as
    llama.cpp's content parser reads it (a format without a reasoning block: the text as written)."""
    if not calls and not fmt.think:
        return Reply(content=text)
    names = None if names is None else set(names)
    if lstrip:
        text = text.lstrip(_WS)
    # a reasoning block the prompt closed (lstrip False) is not reopened by the reply
    reasoning, rest = _split_reasoning(text, fmt, partial) if lstrip else ("", text)
    if reasoning.strip(_WS) == "":
        reasoning = ""
    reply = Reply(reasoning=reasoning)
    if not calls:
        reply.content = rest
        return reply
    marker = fmt.first_marker
    if marker:
        k = rest.find(marker)
        if k < 0:
            reply.content = _held_back(rest, marker) if partial else rest
            return reply
    else:   # llama3: the whole reply is the call
        k = _skip_ws(rest, 0)
        if not rest.startswith("{", k):
            reply.content = rest
            return reply
    try:
        calls, end = _calls(rest, k, fmt, names, partial)
    except ValueError:
        reply.content = rest       # not a call after all (no grammar ran)
        return reply
    # text after the calls (no grammar ran) stays content, after the text before them
    reply.content = (rest[:k] if marker else "") + rest[end:]
    reply.calls = calls
    return reply


def _calls(s: str, k: int, fmt: ToolFormat, names, partial: bool) -> Tuple[List[ToolCall], int]:
    """(the calls from the marker at ``s[k]`` on, where they end): ValueError when the first is not
    a call; text after complete calls ends them (the end is returned, the caller keeps the text)."""
    out: List[ToolCall] = []
    end = len(s)
    i = _skip_ws(s, k + len(fmt.section_open)) if fmt.array else k
    if fmt.array:
        if i >= len(s) and partial:
            return out, end
        if not s.startswith("[", i):
            raise ValueError("expected '['")
        i += 1
    while True:
        start = i
        try:
            i, done = _one_call(s, i, fmt, names, partial, out)
        except ValueError:
            if out:               # complete calls, then something else: that is content
                return out, start
            raise
        if not done:
            return out, end
        if fmt.array:
            if s.startswith("]", i):
                return out, _skip_ws(s, i + 1)
            i += 1                # the ","
        elif i >= len(s) or not fmt.call_open:
            return out, i


def _one_call(s: str, i: int, fmt: ToolFormat, names, partial: bool, out: List[ToolCall]) -> Tuple[int, bool]:
    """Read one call at ``s[i]`` into ``out``: (index after it and what follows it, whether more
    may follow); ValueError when it is not a call."""
    if not fmt.array:
        if not s.startswith(fmt.call_open, i):
            if partial and fmt.call_open.startswith(s[i:]):
                return i, False
            raise ValueError("expected a tool call")
        i += len(fmt.call_open)
    i = _skip_ws(s, i)
    if i >= len(s) and partial:
        return i, False
    call, i, done = _call_from(s, i, fmt, names, partial)
    if call is not None:
        out.append(call)
    i = _skip_ws(s, i)
    if not done or (i >= len(s) and partial):
        return i, False
    if fmt.array:   # "," and the next call, or "]" and the end
        if not s.startswith(("]", ","), i):
            raise ValueError("expected ',' or ']'")
        return i, True
    close = fmt.call_close.strip(_WS)
    if close:
        if not s.startswith(close, i):
            if partial and close.startswith(s[i:]):
                return i, False
            raise ValueError("expected the end of a tool call")
        i = _skip_ws(s, i + len(close))
    return i, True


def whole_if_empty(reply: Reply, text: str) -> Reply:
    """llama-server's message of a reply that parses to nothing (no content, reasoning or calls):
    its whole text as ``content`` (``server-task.cpp``: an empty parsed message is not used)."""
    if not (reply.content or reply.reasoning or reply.calls):
        reply.content = text
    return reply


class ReplyDiffer:
    """Successive parses of a streaming reply -> OpenAI ``delta`` dicts (llama-server's
    ``compute_diffs``: reasoning, then content, then the last known call's new argument text, then
    new calls with their id and name).  A call's id is the model's own where the format has one
    (Mistral: such a call is sent once its object is closed, id and all), else drawn once per index."""

    def __init__(self, fmt: ToolFormat, names: Optional[Iterable[str]] = None, lstrip: bool = True,
                 parse: Optional[Callable[..., Reply]] = None):
        """``parse``: the format's parser, :func:`parse_reply`'s signature (default: parse_reply)."""
        self.fmt = fmt
        self._parse = parse or parse_reply
        self.names = None if names is None else list(names)
        self.lstrip = lstrip
        self.prev = Reply()
        self.ids: List[str] = []

    def _id(self, i: int, own: str) -> str:
        while len(self.ids) <= i:
            self.ids.append("")
        if not self.ids[i]:
            self.ids[i] = own or new_call_id(self.fmt)
        return self.ids[i]

    def update(self, text: str, final: bool = False) -> Tuple[Reply, List[dict]]:
        new = self._parse(text, self.fmt, self.names, partial=not final, lstrip=self.lstrip)
        if self.fmt.id_key and not final and new.calls and not new.calls[-1].complete:
            new.calls = new.calls[:-1]     # its id may still come
        deltas: List[dict] = []
        prev = self.prev
        for key, a, b in (("reasoning_content", prev.reasoning, new.reasoning), ("content", prev.content, new.content)):
            if b != a and b.startswith(a):
                deltas.append({key: b[len(a):]})
        if len(new.calls) < len(prev.calls):   # cannot happen with a prefix of a valid reply
            new.calls = prev.calls + new.calls[len(prev.calls):]
        if prev.calls:
            j = len(prev.calls) - 1
            d = new.calls[j].arguments[len(prev.calls[j].arguments):]
            if d and new.calls[j].arguments.startswith(prev.calls[j].arguments):
                deltas.append({"tool_calls": [{"index": j, "function": {"arguments": d}}]})
        for j in range(len(prev.calls), len(new.calls)):
            c = new.calls[j]
            fn = {"name": c.name}
            if c.arguments:
                fn["arguments"] = c.arguments
            deltas.append({"tool_calls": [{"index": j, "id": self._id(j, c.id), "type": "function", "function": fn}]})
        for j, c in enumerate(new.calls):
            c.id = self._id(j, c.id)
        self.prev = new
        return new, deltas

    def finish(self, text: str, cut: bool = False) -> Tuple[Reply, List[dict]]:
        """The last update, at the reply's end (``cut``: by ``max_tokens``, parsed leniently), with
        llama-server's message of a reply that parses to nothing (:func:`whole_if_empty`)."""
        sent = self.prev.content
        reply, deltas = self.update(text, final=not cut)
        if not (reply.content or reply.reasoning or reply.calls) and text:
            whole_if_empty(reply, text)
            if text.startswith(sent) and text != sent:
                deltas.append({"content": text[len(sent):]})
        return reply, deltas


class ReplyText:
    """Token ids -> reply text, rendering the special tokens of a tool-call format (``[TOOL_CALLS]``
    is a control token: llama-server renders it as a "preserved token").  ``piece(token, special)``
    is the target's ``token_to_piece``; ``eog(token)``: end-of-generation tokens are not text;
    ``stop``: the text ends before the first stop string, and while streaming what may be the start
    of one is held back (as the engine's own text)."""

    def __init__(self, piece: Callable[[int, bool], bytes], eog: Callable[[int], bool], special: Sequence[int] = (),
                 stop: Sequence[str] = ()):
        self._piece, self._eog, self.special = piece, eog, frozenset(int(t) for t in special)
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.stop = [x for x in stop if x]
        self._hold = max((len(x) for x in self.stop), default=1) - 1

    def _cut(self, final: bool) -> str:
        hits = [k for k in (self.text.find(x) for x in self.stop) if k >= 0]
        if hits:
            return self.text[:min(hits)]
        return self.text if final else self.text[:len(self.text) - self._hold]

    def push(self, tokens: Iterable[int]) -> str:
        """The text so far after ``tokens``."""
        self.text += "".join(self._dec.decode(self._piece(int(t), int(t) in self.special)) for t in tokens
                             if not self._eog(int(t)))
        return self._cut(False)

    def finish(self) -> str:
        self.text += self._dec.decode(b"", final=True)
        return self._cut(True)


def message_json(reply: Reply) -> dict:
    """The assistant message of a chat completion, as llama-server writes it
    (``common_chat_msg::to_json_oaicompat``: ``content`` "" when empty)."""
    msg: dict = {"role": "assistant", "content": reply.content}
    if reply.reasoning:
        msg["reasoning_content"] = reply.reasoning
    if reply.calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}, "id": c.id}
                             for c in reply.calls]
    return msg
