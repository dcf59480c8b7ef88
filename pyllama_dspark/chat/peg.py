"""A PEG evaluator with llama.cpp's lenient semantics (``common/peg-parser.cpp``), for the tool-call
parsers that follow llama.cpp's PEG grammars (:mod:`.lfm2`, :mod:`.dsml`): a parser maps (text, index)
to (status, end, nodes), ``MORE`` where the text ends before it could decide (a partial reply); the
nodes are each module's own."""

from __future__ import annotations

from typing import Callable, Tuple

__all__ = ["OK", "FAIL", "MORE", "Result", "Parser", "CSPACE", "lit", "seq", "alt", "rep", "chars", "not_", "space",
           "eps", "end"]

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
