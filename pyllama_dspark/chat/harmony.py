"""GPT-OSS tool calls: OpenAI's harmony channels, as llama.cpp's ``common/parsers/gpt-oss.cpp`` reads
and constrains them (a codec of :mod:`.tool_codecs`).

The prompt ends with the generation prompt ``<|start|>assistant``; the reply is zero or more
messages, each ended by ``<|end|>`` and followed by a new ``<|start|>assistant``, then the answer:

* ``<|channel|>analysis<|message|>...<|end|>``: reasoning (several blocks are concatenated; a stray
  ``<|channel|>commentary`` (`` to=assistant``) before it is tolerated);
* ``<|channel|>commentary<|message|>...<|end|>``: a preamble, which is ``content``;
* a call, with the recipient in the role header (`` to=functions.NAME<|channel|>commentary json
  <|message|>{ARGS}``) or in the channel header (``<|channel|>commentary to=functions.NAME
  <|constrain|>json<|message|>{ARGS}``); the channel may be ``analysis``; the content type
  (``[ws]<|constrain|>?[A-Za-z0-9_-]+``) is optional; the model then ends the turn with ``<|call|>``,
  an end-of-generation token that is no text;
* or a final answer ``<|channel|>final<|message|>TEXT`` (content, up to any ``<|end|>``).

One call per reply (llama-server's grammar and parser take one; ``parallel_tool_calls`` changes
nothing).  :func:`parse` follows llama-server's PEG parser, which reads the generation prompt and the
reply together and always leniently: a text cut inside a construct gives what was read so far (a
call appears once its header up to ``<|message|>`` is complete, its arguments ``{`` until they start),
text after the answer is ignored, a reply that does not fit is its whole text as content (llama-server:
HTTP 500), and a reply that parses to nothing is its whole text as content (as llama-server's message).

:func:`grammar`: ``"required"`` / a named function: ``(any "<|start|>assistant")* call`` (llama-server's
``(start any)* start tool-call`` after its grammar is fed the generation prompt), where ``any`` is an
analysis or preamble message; the arguments are the tool's parameters schema through llama-cpp-python's
converter (the JSON whitespace differs from llama-server's converter: docs/serve.md "Tools").  ``"auto"``:
``"<|start|>assistant"? call`` under a lazy grammar whose trigger words approximate llama-server's
trigger patterns (:data:`TRIGGERS`).
"""

from __future__ import annotations

import json
from typing import Any, Iterable, List, Optional, Sequence, Tuple

from pyllama_dspark.chat.formats import ToolFormat
from pyllama_dspark.chat.tool_grammar import ToolGrammar, ToolSchemaError, until_rules
from pyllama_dspark.chat.parse import Reply, ToolCall, whole_if_empty

__all__ = ["grammar", "parse", "adjust_messages", "TRIGGERS", "GEN_PROMPT"]

GEN_PROMPT = "<|start|>assistant"
START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>assistant", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"

# llama-server's lazy grammar starts at its trigger patterns (gpt-oss.cpp):
#   ^\s+to$                                    a reply that starts with the role-header recipient
#   ^<|channel|>(commentary|analysis)\s+to=functions$   ... with the channel-header recipient
#   <|start|>assistant(\s+to)                  a later message with the role-header recipient
#   <|start|>assistant(<|channel|>(commentary|analysis)\s+to)   ... with the channel-header one
# and never inside an analysis block (its reasoning-budget sampler).  Our LazyGrammar finds words
# anywhere outside the analysis blocks (ToolFormat.think), and its grammar takes the optional
# "<|start|>assistant" the two last words start with.  The differences: one space before "to" (not
# any whitespace), and the two reply-start patterns are words found anywhere: the role-header one
# only once " to=functions" is written (llama-server constrains from " to" at the start on).
TRIGGERS: Tuple[str, ...] = (
    START + " to", START + CHANNEL + "commentary to", START + CHANNEL + "analysis to",
    CHANNEL + "commentary to=functions", CHANNEL + "analysis to=functions", " to=functions")


def adjust_messages(msgs: List[dict]) -> List[dict]:
    """``reasoning_content`` -> ``thinking`` (the template's field; an assistant message with calls
    then loses its ``content``), as gpt-oss.cpp does before rendering."""
    out = []
    for m in msgs:
        if isinstance(m.get("reasoning_content"), str):
            m = dict(m, thinking=m["reasoning_content"])
            if m.get("tool_calls"):
                m.pop("content", None)
        out.append(m)
    return out


# ---- grammar ------------------------------------------------------------------------------------------
def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def grammar(fmt: ToolFormat, tools: Sequence[dict], choice: Any, parallel: bool,
            think: bool = True) -> Optional[ToolGrammar]:
    """The request's grammar (module doc); None for "none"; ToolSchemaError for a schema the
    converter cannot do.  ``parallel`` and ``think`` change nothing (one call; analysis always allowed)."""
    from llama_cpp.llama_grammar import SchemaConverter

    if choice == "none" or not tools:
        return None
    named = choice.get("name") if isinstance(choice, dict) else None
    use = [t for t in tools if t["function"]["name"] == named] if named else list(tools)
    conv = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    calls = []
    for i, t in enumerate(use):
        f = t["function"]
        params = f.get("parameters")
        if params is None or params == {}:     # llama.cpp's common_chat_tool_parameters
            params = {"type": "object", "properties": {}}
        try:
            args = conv.visit(conv.resolve_refs(params, f"tool-{i}"), f"h-args-{i}")
        except RecursionError:
            raise ToolSchemaError(f"tool {f['name']!r}: its parameters schema nests too deeply") from None
        except Exception as e:   # the converter asserts / raises on what it does not support
            raise ToolSchemaError(f"tool {f['name']!r}: unsupported parameters schema: "
                                  f"{type(e).__name__}: {e}") from None
        to = _lit(" to=functions." + f["name"])
        msg = _lit(MESSAGE)
        calls.append(f"h-tool-{i} ::= ({to} h-chan h-type? {msg} | h-chan {to} h-type? {msg}) {args}")
    rules = [conv.format_grammar().strip()] + calls
    rules += ["h-call ::= " + " | ".join(f"h-tool-{i}" for i in range(len(use))),
              f'h-chan ::= {_lit(CHANNEL)} ("commentary" | "analysis")',
              f'h-type ::= h-space {_lit(CONSTRAIN)}? [A-Za-z0-9_-]+',
              'h-space ::= | " " | "\\n"{1,2} [ \\t]{0,20}']      # llama-server's space rule
    if choice == "auto":
        rules.append(f"root ::= {_lit(START)}? h-call")
        return ToolGrammar("\n".join(rules) + "\n", True, TRIGGERS, False)
    rules += [f'h-any ::= h-preamble | h-analysis',
              f'h-analysis ::= ({_lit(CHANNEL + "commentary")} " to=assistant"?)? '
              f'{_lit(CHANNEL + "analysis" + MESSAGE)} h-msg-0',
              f'h-preamble ::= {_lit(CHANNEL + "commentary" + MESSAGE)} h-msg-0',
              f"root ::= (h-any {_lit(START)})* h-call"]
    rules += until_rules("h-msg", END)
    return ToolGrammar("\n".join(rules) + "\n", False)


# ---- parser: llama-server's PEG parser, always lenient --------------------------------------------------
OK, NEED, FAIL = 0, 1, 2
_SPACE = " \t\n\v\f\r"       # C isspace


class _P:
    """One parse of ``s`` (the generation prompt and the reply).  Each method returns (status, end,
    events); events: ("reasoning" | "content", text) and ("call", name, args text or None)."""

    def __init__(self, s: str, names: Optional[Sequence[str]], calls: bool = True):
        self.s, self.n, self.names, self.calls = s, len(s), None if names is None else list(names), calls

    def lit(self, pos: int, word: str):
        for i, c in enumerate(word):
            if pos + i >= self.n:
                return NEED, pos + i, []
            if self.s[pos + i] != c:
                return FAIL, pos, []
        return OK, pos + len(word), []

    def seq(self, pos: int, *parts):
        ev: list = []
        for p in parts:
            st, end, e = p(pos)
            if st == FAIL:
                return FAIL, pos, []
            ev += e
            if st == NEED:
                return NEED, end, ev
            pos = end
        return OK, pos, ev

    def alt(self, pos: int, *parts):
        for p in parts:
            r = p(pos)
            if r[0] != FAIL:
                return r
        return FAIL, pos, []

    def opt(self, pos: int, part):
        if pos >= self.n:
            return OK, pos, []
        st, end, e = part(pos)
        return (OK, pos, []) if st == FAIL else (st, end, e)

    def until_end(self, pos: int):
        """Text up to ``<|end|>`` (or up to a cut-off start of it at the end); NEED at the end."""
        k = self.s.find(END, pos)
        if k >= 0:
            return OK, k, []
        for j in range(max(pos, self.n - len(END) + 1), self.n):
            if END.startswith(self.s[j:]):
                return OK, j, []
        return NEED, self.n, []

    def tagged(self, kind: str, part):
        def run(pos):
            st, end, e = part(pos)
            return (st, end, e) if st == FAIL else (st, end, e + [(kind, self.s[pos:end])])
        return run

    # ---- the messages
    def stray(self, pos):
        return self.opt(pos, lambda p: self.seq(p, lambda q: self.lit(q, CHANNEL + "commentary"),
                                                lambda q: self.opt(q, lambda r: self.lit(r, " to=assistant"))))

    def analysis(self, pos):
        return self.seq(pos, self.stray, lambda p: self.lit(p, CHANNEL + "analysis" + MESSAGE),
                        self.tagged("reasoning", self.until_end), lambda p: self.lit(p, END))

    def preamble(self, pos):
        return self.seq(pos, lambda p: self.lit(p, CHANNEL + "commentary" + MESSAGE),
                        self.tagged("content", self.until_end), lambda p: self.lit(p, END))

    def final(self, pos):
        return self.seq(pos, self.stray, lambda p: self.lit(p, CHANNEL + "final" + MESSAGE),
                        self.tagged("content", self.until_end))

    def channel(self, pos):
        return self.seq(pos, lambda p: self.lit(p, CHANNEL),
                        lambda p: self.alt(p, lambda q: self.lit(q, "commentary"), lambda q: self.lit(q, "analysis")))

    def ctype(self, pos):
        def one(p):
            while p < self.n and self.s[p] in _SPACE:
                p += 1
            st, p, _ = self.opt(p, lambda q: self.lit(q, "<|constrain|>"))
            if st != OK:
                return st, p, []
            k = p
            while k < self.n and (self.s[k].isascii() and (self.s[k].isalnum() or self.s[k] in "_-")):
                k += 1
            if k > p:
                return OK, k, []
            return (NEED, k, []) if k >= self.n else (FAIL, p, [])
        return self.opt(pos, one)

    def tool(self, pos, name: Optional[str]):
        """A call of ``name`` (None: any name, up to whitespace or a control token)."""
        seen: List[str] = []

        def to(p):
            st, p, _ = self.lit(p, " to=functions.")
            if st != OK or name is not None:
                return self.lit(p, name) if st == OK else (st, p, [])
            k = p
            while k < self.n and self.s[k] not in _SPACE and self.s[k] != "<":
                k += 1
            if k >= self.n or k == p:
                return (NEED, k, []) if k >= self.n else (FAIL, p, [])
            seen.append(self.s[p:k])
            return OK, k, []

        msg = lambda p: self.lit(p, MESSAGE)                                          # noqa: E731
        for header in ((to, self.channel, self.ctype, msg), (self.channel, to, self.ctype, msg)):
            seen.clear()
            st, end, _ = self.seq(pos, *header)
            if st == FAIL:
                continue
            if st == NEED:               # an atomic header: nothing until it is complete
                return NEED, end, []
            ast, aend = _json(self.s, end)
            if ast == FAIL:
                continue
            return ast, aend, [("call", name or seen[-1], self.s[end:aend])]
        return FAIL, pos, []

    def root(self):
        start = lambda p: self.lit(p, START)                                          # noqa: E731
        any_ = lambda p: self.alt(p, self.preamble, self.analysis)                    # noqa: E731
        pos, ev = 0, []
        while pos < self.n:
            st, end, e = self.seq(pos, start, any_)
            if st == NEED:
                return NEED, ev + e
            if st == FAIL or end == pos:
                break
            ev += e
            pos = end
        if not self.calls:   # tool_choice "none": a final answer, or a call consumed as nothing
            st, _, e = self.seq(pos, start, lambda p: self.alt(p, self.final, self.unsolicited))
            return st, ev + e
        tools = [lambda p, n=n: self.tool(p, n) for n in (self.names if self.names is not None else [None])]
        st, _, e = self.seq(pos, start, lambda p: self.alt(p, *tools, self.final))
        return st, ev + e

    def unsolicited(self, pos):
        """gpt-oss.cpp's "unsolicited" message (its parser without tools): an atomic
        ``(<|channel|>(commentary|analysis))? to=...<|end|>``, read as nothing."""
        st, end, _ = self.seq(pos, lambda p: self.opt(p, self.channel), lambda p: self.lit(p, " to="),
                              self.until_end, lambda p: self.lit(p, END))
        return st, end, []


def _json(s: str, i: int) -> Tuple[int, int]:
    """(status, end) of the JSON value at ``s[i]`` as llama-server's lenient PEG reads it: NEED when
    the text ends inside it (end: what was read, without a cut-off escape)."""
    n = len(s)

    def ws(p):
        while p < n and s[p] in _SPACE:
            p += 1
        return p

    def lit(p, w):
        for k, c in enumerate(w):
            if p + k >= n:
                return NEED, p + k
            if s[p + k] != c:
                return FAIL, p
        return OK, p + len(w)

    def string(p):
        st, p = lit(p, '"')
        if st != OK:
            return st, p
        while p < n:
            c = s[p]
            if c == '"':
                return OK, p + 1
            if c == "\\":
                if p + 1 >= n:
                    return NEED, p
                e = s[p + 1]
                if e in '"\\/bfnrt':
                    p += 2
                elif e == "u":
                    h = s[p + 2:p + 6]
                    if not all(x in "0123456789abcdefABCDEF" for x in h):
                        return FAIL, p
                    if len(h) < 4:
                        return NEED, p
                    p += 6
                else:
                    return FAIL, p
            else:
                p += 1
        return NEED, p

    def digits(p):
        k = p
        while k < n and s[k].isascii() and s[k].isdigit():
            k += 1
        return k

    def number(p):
        q = p + 1 if s.startswith("-", p) else p
        if q >= n:
            return NEED, q
        if s[q] == "0":
            q += 1
        elif s[q] in "123456789":
            q = digits(q + 1)
        else:
            return FAIL, p
        for lead, sign in ((".", ""), ("eE", "+-")):
            if q < n and s[q] in lead:
                r = q + 1
                if sign and r < n and s[r] in sign:
                    r += 1
                d = digits(r)
                if d == r:
                    if r >= n:
                        return NEED, r
                    break              # not a fraction / exponent: the lookahead below fails
                q = d
        if q >= n:
            return NEED, q
        return (FAIL, p) if s[q] in "0123456789.eE+-" else (OK, q)

    def container(p, close, item):
        p = ws(p + 1)
        if p >= n:
            return NEED, p
        if s[p] == close:
            return OK, p + 1
        while True:
            st, p = item(p)
            if st != OK:
                return st, p
            q = ws(p)
            if q >= n:
                return NEED, q
            if s[q] == close:
                return OK, q + 1
            if s[q] != ",":
                return FAIL, q
            p = ws(q + 1)
            if p >= n:
                return NEED, p

    def member(p):
        st, p = string(p)
        if st != OK:
            return st, p
        p = ws(p)
        st, p = lit(p, ":")
        if st != OK:
            return st, p
        return value(ws(p))

    def value(p):
        if p >= n:
            return NEED, p
        c = s[p]
        if c == "{":
            return container(p, "}", member)
        if c == "[":
            return container(p, "]", value)
        if c == '"':
            return string(p)
        if c == "-" or c.isascii() and c.isdigit():
            return number(p)
        for w in ("true", "false", "null"):
            if w[0] == c:
                return lit(p, w)
        return FAIL, p

    return value(i)


def parse(text: str, fmt: ToolFormat, names: Optional[Iterable[str]] = None, *, partial: bool = False,
          lstrip: bool = True, calls: bool = True) -> Reply:
    """A reply's text (after the generation prompt) -> content, reasoning (the analysis blocks) and
    its call, as llama-server parses it (module doc).  ``names``: the request's tools (None: any name); ``lstrip`` is
    ignored (the reply's leading space is the role-header recipient's).  ``calls`` False (``tool_choice:
    "none"``): llama-server's parser without tools, whose answer is a final message or a call, read as
    nothing."""
    try:
        st, events = _P(GEN_PROMPT + text, None if names is None else list(names), calls).root()
    except RecursionError:     # JSON nested beyond Python's stack (no grammar ran): not a call
        st, events = FAIL, []
    if st == FAIL:
        return Reply(content=text)
    reply = Reply()
    for ev in events:
        if ev[0] == "reasoning":
            reply.reasoning += ev[1]
        elif ev[0] == "content":
            reply.content += ev[1]
        else:
            args = ev[2].rstrip(_SPACE)
            reply.calls.append(ToolCall(ev[1], args if args.startswith("{") else "{", "", st == OK))
    if not reply.reasoning.strip(" \n\r\t"):
        reply.reasoning = ""
    return reply if partial else whole_if_empty(reply, text)
