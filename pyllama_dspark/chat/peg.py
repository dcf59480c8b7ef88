"""A PEG evaluator with llama.cpp's lenient semantics (``common/peg-parser.cpp``), for the tool-call
parsers that follow llama.cpp's PEG grammars (:mod:`.lfm2`, :mod:`.dsml`): a parser maps (text, index)
to (status, end, nodes), ``MORE`` where the text ends before it could decide (a partial reply); the
nodes are each module's own."""

from __future__ import annotations

import string
from typing import Callable, Tuple

__all__ = ["OK", "FAIL", "MORE", "Result", "Parser", "CSPACE", "lit", "seq", "alt", "rep", "chars", "not_", "space",
           "eps", "end", "rest", "until", "tag", "json_value", "json_number", "string_inside", "brace_depth"]

CSPACE = " \t\n\r\v\f"      # C isspace


OK, FAIL, MORE = 0, 1, 2
Result = Tuple[int, int, list]                 # (status, end, nodes)
Parser = Callable[[str, int], Result]


def lit(t: str) -> Parser:
    def p(s: str, i: int) -> Result:
        for k, c in enumerate(t):
            if i + k >= len(s):
                return MORE, i + k, []
            if s[i + k] != c:
                return FAIL, i, []
        return OK, i + len(t), []
    return p


def seq(*ps: Parser) -> Parser:
    def p(s: str, i: int) -> Result:
        nodes: list = []
        for q in ps:
            st, i, n = q(s, i)
            if st == FAIL:
                return FAIL, i, []
            nodes += n
            if st == MORE:
                return MORE, i, nodes
        return OK, i, nodes
    return p


def alt(*ps: Parser) -> Parser:
    def p(s: str, i: int) -> Result:
        for q in ps:
            r = q(s, i)
            if r[0] != FAIL:
                return r
        return FAIL, i, []
    return p


def rep(q: Parser, lo: int = 0, hi: int = -1) -> Parser:
    def p(s: str, i: int) -> Result:
        nodes: list = []
        count = 0
        while hi == -1 or count < hi:
            if i >= len(s):
                break
            st, e, n = q(s, i)
            if st == OK:
                if e == i:
                    break
                nodes += n
                i, count = e, count + 1
                continue
            if st == MORE:
                return MORE, e, nodes + n
            break
        if count < lo:
            return (MORE, i, nodes) if i >= len(s) else (FAIL, i, [])
        return OK, i, nodes
    return p


def chars(ok: Callable[[str], bool], lo: int = 1, hi: int = -1) -> Parser:
    def p(s: str, i: int) -> Result:
        count = 0
        while (hi == -1 or count < hi) and i < len(s) and ok(s[i]):
            i, count = i + 1, count + 1
        if count < lo:
            return (MORE, i, []) if i >= len(s) else (FAIL, i, [])
        return OK, i, []
    return p


def not_(q: Parser) -> Parser:
    def p(s: str, i: int) -> Result:
        st = q(s, i)[0]
        return (FAIL if st == OK else MORE if st == MORE else OK), i, []
    return p


def space(s: str, i: int) -> Result:
    while i < len(s) and s[i] in CSPACE:
        i += 1
    return OK, i, []


def eps(s: str, i: int) -> Result:
    return OK, i, []


def end(s: str, i: int) -> Result:
    return (OK if i >= len(s) else FAIL), i, []


def rest(s: str, i: int) -> Result:
    return OK, len(s), []


def until(*stops: str) -> Parser:
    """Text up to the first of ``stops`` (or up to a start of one that the text ends in)."""
    def p(s: str, i: int) -> Result:
        while i < len(s):
            if any(s.startswith(w, i) or (len(s) - i < len(w) and w.startswith(s[i:])) for w in stops):
                return OK, i, []
            i += 1
        return MORE, i, []
    return p


def tag(name: str, q: Parser, atomic: bool = False) -> Parser:
    """A tagged node ``(name, start, end, children)``; ``atomic``: none while its text is not all there."""
    def p(s: str, i: int) -> Result:
        st, e, n = q(s, i)
        if st == FAIL:
            return st, e, n
        return st, e, ([] if atomic and st == MORE else [(name, i, e, n)])
    return p


# ---- a JSON value (llama.cpp's p.json(): no whitespace before or after it) ------------------------------
def string_inside(q: str) -> Parser:
    """The inside of a string quoted by ``q`` (JSON escapes and ``\\q``)."""
    def p(s: str, i: int) -> Result:
        start = i
        while i < len(s):
            c = s[i]
            if c == q:
                return OK, i, []
            if c != "\\":
                i += 1
                continue
            if i + 1 >= len(s):
                return MORE, i, []
            e = s[i + 1]
            if e in q + "\\/bfnrt":
                i += 2
            elif e == "u":
                for k in range(4):
                    if i + 2 + k >= len(s):
                        return MORE, i, []
                    if s[i + 2 + k] not in string.hexdigits:
                        return FAIL, start, []
                i += 6
            else:
                return FAIL, start, []
        return MORE, i, []
    return p


_JSTR = seq(lit('"'), string_inside('"'), lit('"'))
_DIGITS = chars(lambda c: c in string.digits)
json_number = seq(rep(lit("-"), 0, 1), alt(lit("0"), seq(chars(lambda c: c in "123456789", 1, 1),
                                                  chars(lambda c: c in string.digits, 0))),
           rep(seq(lit("."), _DIGITS), 0, 1),
           rep(seq(alt(lit("e"), lit("E")), rep(chars(lambda c: c in "+-", 1, 1), 0, 1), _DIGITS), 0, 1),
           not_(chars(lambda c: c in "0123456789.eE+-", 1, 1)))
json_value: Parser = lambda s, i: _JSON_DEF(s, i)   # noqa: E731
_MEMBER = seq(_JSTR, space, lit(":"), space, json_value)
_OBJ = seq(lit("{"), space, alt(lit("}"), seq(_MEMBER, rep(seq(space, lit(","), space, _MEMBER)), space, lit("}"))))
_ARR = seq(lit("["), space, alt(lit("]"), seq(json_value, rep(seq(space, lit(","), space, json_value)),
                                             space, lit("]"))))
_JSON_DEF = alt(_OBJ, _ARR, _JSTR, json_number, lit("true"), lit("false"), lit("null"))


def brace_depth(s: str) -> int:
    """How many ``{`` of the JSON text ``s`` are still open (llama.cpp's ``json_brace_depth``)."""
    depth, in_str, esc = 0, False, False
    for c in s:
        if esc:
            esc = False
        elif c == "\\" and in_str:
            esc = True
        elif c == '"':
            in_str = not in_str
        elif not in_str:
            depth += (c == "{") - (c == "}")
    return depth
