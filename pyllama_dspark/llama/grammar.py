"""GBNF / JSON-schema constrained decoding through llama.cpp's own grammar engine.

Nothing here parses or runs a grammar: :class:`Grammar` owns one ``llama_sampler`` made by
``llama_sampler_init_grammar`` (llama.cpp's GBNF parser and pushdown matcher) and drives it through
llama-cpp-python's low-level bindings; :func:`schema_to_gbnf` is llama-cpp-python's
``json_schema_to_gbnf``.  :class:`GrammarCursor` keeps the grammar state of one sequence in a
speculative loop: the committed state plus a scratch state advanced along the drafted block.

What llama.cpp does on bad input, and what this module does first (it never lets it happen):

* ``llama_sampler_accept`` with a token the grammar rejects throws ``std::runtime_error`` through
  the C API (the process aborts), an end-of-generation (EOG) token while the grammar is not
  complete hits ``GGML_ABORT``, an id outside the vocabulary throws ``std::out_of_range``:
  :meth:`Grammar.accept` checks the token with a one-token ``llama_sampler_apply`` first.
* The parser reports syntax errors, undefined rules, a missing root and left recursion by
  printing (``fprintf(stderr)`` and llama.cpp's log) and returning NULL: the message is captured
  and raised as :class:`GrammarError`.
* Empty text gives a sampler that constrains nothing; ``x{m,n}`` with ``n < m`` makes the parser
  generate rules until memory runs out; deep ``(`` nesting and long rule chains overflow the C
  stack in its recursive parser / left-recursion check (segfault at ~20k levels on an 8 MiB
  stack) and a long chain of leftmost references takes memory quadratic in its length (23 GB for
  200k rules); a NUL character cuts the text: all are refused here (``_scan``: limits on nesting,
  rules and expanded size), and the parser runs on a thread with a known 128 MiB stack.
* Not guarded: an exponentially ambiguous grammar (``r0 ::= "" | r1 r1``, ``r1 ::= "" | r2 r2``,
  ...) makes llama.cpp's stack expansion take exponential time and memory (init of a 20-rule
  chain runs for minutes); repetition bounds above 2000 are silently made unbounded by llama.cpp.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import sys
import tempfile
import threading
from typing import List, Optional, Sequence

import numpy as np
from llama_cpp import llama_cpp as ll
from llama_cpp import llama_grammar as _lg

from pyllama_dspark.errors import ClosedError, DSparkError
from pyllama_dspark.llama.handles import Owned

__all__ = ["GrammarError", "JSON_OBJECT_GBNF", "schema_to_gbnf", "Grammar", "GrammarCursor"]


class GrammarError(DSparkError, ValueError):
    """A grammar or JSON schema that cannot be used, or a token the grammar does not allow."""


# "any JSON object" (response_format json_object): llama-cpp-python's JSON grammar, whose root is
# its object rule (the grammar its own chat handlers use for json_object)
JSON_OBJECT_GBNF: str = _lg.JSON_GBNF

# ---- limits checked before llama.cpp sees the text (see the module's doc) ---------------------------
MAX_NESTING = 6_000         # '(' depth: the parser recurses ~0.5 KiB of C stack per level
# rules (written + generated): the left-recursion check recurses per rule, and llama.cpp's stack
# expansion over a chain of d leftmost references takes ~6 d^2 bytes (0.9 GB at this limit)
MAX_RULES = 12_000
MAX_ELEMENTS = 4_000_000    # grammar elements once repetitions are expanded (8 bytes each)
_REPEAT_CAP = 2000          # llama.cpp's MAX_REPETITION_THRESHOLD
_STACK_BYTES = 128 << 20    # stack of the thread the parser runs on
_NAME_RE = re.compile(r"[A-Za-z0-9-]+\Z")
_WS = r"(?:[ \t\r\n]|#[^\r\n]*)*"
# comments, literals, char classes, tokens (unterminated: to the end), groups, repetition operators
_LEX_RE = re.compile(r'#[^\r\n]*|"(?:\\.|[^"\\])*"?|\[(?:\\.|[^\]\\])*\]?|<[^>]*>?|[()*+?{]', re.S)
_REPEAT_RE = re.compile(r"\{" + _WS + r"(\d+)" + _WS + r"(?:(\})|," + _WS + r"(\d*)" + _WS + r"\})")


def _scan(text: str) -> None:
    """Refuse what llama.cpp would crash, hang or exhaust memory on (module doc).  Only the lexical
    level is read (comments, literals, classes, tokens, groups, repetitions); everything else,
    syntax included, is left to llama.cpp's parser."""
    if "\x00" in text:
        raise GrammarError("grammar text contains a NUL character (llama.cpp would cut the text there)")
    depth, n_rules, n_elems = 0, text.count("::="), len(text)
    last = 1          # element count of the last item (what a repetition copies)
    for m in _LEX_RE.finditer(text):
        c = m.group()[0]
        if c == "(":
            depth += 1
            n_rules += 1
            if depth > MAX_NESTING:
                raise GrammarError(f"grammar nests groups deeper than {MAX_NESTING} levels "
                                   "(llama.cpp's recursive parser would overflow its stack)")
        elif c == ")":
            depth, last = max(0, depth - 1), 1
        elif c in "*+?":
            n_rules += 1
            n_elems += last + 2
            last += 1
        elif c == "{" and (r := _REPEAT_RE.match(text, m.start())) is not None:   # else: llama.cpp reports it
            lo = int(r.group(1))
            hi = lo if r.group(2) else (int(r.group(3)) if r.group(3) else None)
            if hi is not None and hi < lo:
                raise GrammarError(f"repetition {r.group(0)!r}: the maximum {hi} is below the minimum {lo} "
                                   "(llama.cpp would generate rules until memory runs out)")
            if lo <= _REPEAT_CAP:    # above: llama.cpp refuses it itself
                bounded = hi is not None and hi <= _REPEAT_CAP
                n_rules += (hi - lo) if bounded else 1
                copies = max(1, hi if bounded else lo + 1)
                n_elems += copies * (last + 2)
                last = copies * last
        elif c in '"[':
            last = max(1, len(m.group()) - 2)
        elif c == "<":
            last = 1
        if n_rules > MAX_RULES or n_elems > MAX_ELEMENTS:
            raise GrammarError(f"grammar too large once its repetitions are expanded (over {MAX_RULES} rules "
                               f"or {MAX_ELEMENTS} elements)")


def _encode(gbnf, root: str) -> tuple:
    if isinstance(gbnf, (bytes, bytearray)):
        try:
            gbnf = bytes(gbnf).decode("utf-8")
        except UnicodeDecodeError as e:
            raise GrammarError(f"grammar text is not valid UTF-8: {e}") from None
    if not isinstance(gbnf, str):
        raise GrammarError(f"a grammar must be GBNF text (str), got {type(gbnf).__name__}")
    if not isinstance(root, str) or not _NAME_RE.match(root):
        raise GrammarError(f"root rule name must be letters, digits and '-', got {root!r}")
    if not gbnf:   # llama.cpp would return a sampler that constrains nothing
        raise GrammarError("empty grammar")
    try:
        data = gbnf.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GrammarError(f"grammar text cannot be encoded as UTF-8: {e}") from None
    _scan(gbnf)
    return gbnf, data, root.encode()


# ---- running llama.cpp's parser: a thread with a known stack, its messages captured ---------------
_compile_lock = threading.Lock()
_tls = threading.local()
_prev_log: list = [None, None]     # the log callback (and user data) in place while compiling


def _log_sink(level, text, user_data):
    sink = getattr(_tls, "sink", None)
    if sink is not None:           # the compiling thread: keep the message
        sink.append(text.decode("utf-8", "replace") if text else "")
    elif _prev_log[0]:             # anyone else: pass it on
        _prev_log[0](level, text, _prev_log[1])


_LOG_SINK = ll.llama_log_callback(_log_sink)
_libc = ctypes.CDLL(None)
_PARSE_MARK = "error parsing grammar: "


def _init_sampler(vocab, data: bytes, root: bytes):
    # LLAMA_API struct llama_sampler * llama_sampler_init_grammar(
    #         const struct llama_vocab * vocab, const char * grammar_str, const char * grammar_root);
    # NULL on failure: the parser fprintf()s its error to stderr, the rest goes to llama.cpp's log
    out: dict = {}

    def work():
        _tls.sink = out.setdefault("log", [])
        try:
            out["ptr"] = ll.llama_sampler_init_grammar(vocab, data, root)
        except BaseException as e:  # pragma: no cover - ctypes argument errors
            out["exc"] = e
        finally:
            _tls.sink = None

    with _compile_lock:
        cb, ud = ll.llama_log_callback(), ctypes.c_void_p()
        ll.llama_log_get(ctypes.byref(cb), ctypes.byref(ud))
        _prev_log[:] = [cb, ud]
        sys.stderr.flush()
        saved = os.dup(2)
        tmp = tempfile.TemporaryFile()
        try:
            os.dup2(tmp.fileno(), 2)
            ll.llama_log_set(_LOG_SINK, ctypes.c_void_p(0))
            old = threading.stack_size(_STACK_BYTES)
            try:
                t = threading.Thread(target=work, name="gbnf-parse", daemon=True)
                t.start()
            finally:
                threading.stack_size(old)
            t.join()
            _libc.fflush(None)
        finally:
            ll.llama_log_set(cb, ud)
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            captured = tmp.read().decode("utf-8", "surrogateescape")
            tmp.close()
    if "exc" in out:
        raise out["exc"]
    parse_msg, rest = _take_parse_error(captured, data.decode("utf-8", "surrogateescape"))
    if rest:   # someone else's output written while fd 2 was redirected
        os.write(2, rest.encode("utf-8", "surrogateescape"))
    msgs = ([parse_msg] if parse_msg else []) + [m.strip() for m in out.get("log", []) if m.strip()]
    return out.get("ptr"), msgs


def _take_parse_error(captured: str, src: str) -> tuple:
    """(the parser's error, shortened; what else was captured) from fd 2's capture."""
    k = captured.find(_PARSE_MARK)
    if k < 0:
        return "", captured
    start = captured.rfind("\n", 0, k) + 1
    tail = "\n\n" + src + "\n"
    end = captured.find(tail, k)
    what = captured[k + len(_PARSE_MARK):(end if end >= 0 else len(captured))]
    rest = captured[:start] + (captured[end + len(tail):] if end >= 0 else "")
    what = what.split("\n", 1)[0].strip() + (" ..." if "\n" in what.strip() else "")
    return (what[:160] + " ..." if len(what) > 160 else what), rest


def _compile_ptr(vocab, gbnf, root: str):
    text, data, root_b = _encode(gbnf, root)
    ptr, msgs = _init_sampler(vocab, data, root_b)
    if not ptr:
        raise GrammarError("llama.cpp could not parse the grammar: " + ("; ".join(msgs) or "no reason given"))
    return text, ptr


def schema_to_gbnf(schema) -> str:
    """GBNF for a JSON schema (a dict, or True / False) by llama-cpp-python's converter, checked by
    llama.cpp's parser.  ``True`` is the empty schema (the converter makes it "any object");
    ``False`` admits nothing.  Anything the converter cannot do raises :class:`GrammarError`."""
    if isinstance(schema, bool):
        if not schema:
            raise GrammarError("the JSON schema false admits no value")
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object (dict) or a boolean, got {type(schema).__name__}")
    try:
        import jsonschema   # optional: the schema itself checked against its meta-schema
    except ImportError:  # pragma: no cover
        jsonschema = None
    try:
        if jsonschema is not None:
            jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        raise GrammarError(f"invalid JSON schema: {e.message}") from None
    try:
        text = json.dumps(schema)
        gbnf = _lg.json_schema_to_gbnf(text)
    except RecursionError:
        raise GrammarError("unsupported JSON schema: nested too deeply") from None
    except Exception as e:  # the converter asserts / raises on what it does not support
        raise GrammarError(f"unsupported JSON schema: {type(e).__name__}: {e}") from None
    try:
        _, ptr = _compile_ptr(None, gbnf, "root")    # the parser alone needs no vocabulary
    except GrammarError as e:
        raise GrammarError(f"unsupported JSON schema: its grammar is refused: {e}") from None
    ll.llama_sampler_free(ptr)
    return gbnf


_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(ll.llama_token_data)


def _scratch(n: int):
    """This thread's llama_token_data buffer of n entries and its llama_token_data_array."""
    bufs = getattr(_tls, "bufs", None)
    if bufs is None:
        bufs = _tls.bufs = {}
    hit = bufs.get(n)
    if hit is None:
        buf = np.zeros(n, dtype=_TOKEN_DATA)
        arr = ll.llama_token_data_array(ctypes.cast(buf.ctypes.data, ll.llama_token_data_p), n, -1, False)
        hit = bufs[n] = (buf, arr, np.arange(n, dtype=np.int32))
    return hit


class Grammar(Owned):
    """One llama.cpp grammar sampler (owned; ``close()``, context manager) over a target's
    vocabulary.  Not thread-safe: one thread at a time per object."""

    def __init__(self, ptr, target, gbnf: str, root: str):   # use compile() / clone()
        self._ptr = ptr
        self._target = target
        self.gbnf, self.root = gbnf, root
        self.n_vocab = int(target.n_vocab)
        self._eog = np.asarray(target.eog_mask, dtype=bool)
        self._allowed: Optional[np.ndarray] = None   # allowed-token mask of the current state
        self.n_accepted = 0                          # tokens accepted so far (EOG excluded)

    @classmethod
    def compile(cls, gbnf: str, target, root: str = "root") -> "Grammar":
        """Compile GBNF text against ``target``'s vocabulary (an object with ``vocab``,
        ``n_vocab`` and ``eog_mask``); :class:`GrammarError` with llama.cpp's message if it fails."""
        if getattr(target, "_closed", False):
            raise ClosedError("target is closed")
        if not getattr(target, "vocab", None):
            raise GrammarError("the target has no vocabulary")
        text, ptr = _compile_ptr(target.vocab, gbnf, root)
        return cls(ptr, target, text, root)

    # ---- ownership --------------------------------------------------------------------------------
    def _alive(self):
        if not self._ptr:
            raise ClosedError("grammar is closed")
        if getattr(self._target, "_closed", False):
            raise ClosedError("the grammar's target is closed")

    def close(self) -> None:
        # LLAMA_API void llama_sampler_free(struct llama_sampler * smpl);
        if getattr(self, "_ptr", None):
            ll.llama_sampler_free(self._ptr)
            self._ptr = None

    def clone(self) -> "Grammar":
        """An independent copy of the current state."""
        # LLAMA_API struct llama_sampler * llama_sampler_clone(const struct llama_sampler * smpl);
        self._alive()
        ptr = ll.llama_sampler_clone(self._ptr)
        if not ptr:
            raise GrammarError("llama_sampler_clone failed")
        g = Grammar(ptr, self._target, self.gbnf, self.root)
        g._allowed, g.n_accepted = self._allowed, self.n_accepted
        return g

    # ---- queries ----------------------------------------------------------------------------------
    def _apply(self, buf, arr, n: int) -> None:
        # LLAMA_API void llama_sampler_apply(struct llama_sampler * smpl, llama_token_data_array * cur_p);
        # sets the logit of every candidate the grammar rejects to -INFINITY (an EOG token: allowed
        # only when some parse is complete; an empty piece: never)
        arr.data = ctypes.cast(buf.ctypes.data, ll.llama_token_data_p)
        arr.size, arr.selected, arr.sorted = n, -1, False
        ll.llama_sampler_apply(self._ptr, ctypes.byref(arr))

    def allowed(self) -> np.ndarray:
        """bool [n_vocab], read-only: the tokens the grammar accepts now (one apply over the
        vocabulary, cached until the state changes)."""
        self._alive()
        if self._allowed is None:
            buf, arr, ids = _scratch(self.n_vocab)
            buf["id"] = ids
            buf["logit"] = 0.0
            self._apply(buf, arr, self.n_vocab)
            ok = buf["logit"] != -np.inf
            ok.flags.writeable = False
            self._allowed = ok
        return self._allowed

    def allows(self, token: int) -> bool:
        """Whether the grammar accepts ``token`` now (EOG: when the grammar may end here)."""
        self._alive()
        token = int(token)
        if not 0 <= token < self.n_vocab:
            return False
        if self._allowed is not None:
            return bool(self._allowed[token])
        buf, arr, _ = _scratch(1)
        buf[0] = (token, 0.0, 0.0)
        self._apply(buf, arr, 1)
        return bool(buf[0]["logit"] != -np.inf)

    def mask(self, logits) -> np.ndarray:
        """A float32 copy of a [n_vocab] logits row with every token the grammar rejects at -inf."""
        row = np.array(logits, dtype=np.float32, copy=True).reshape(-1)
        if row.shape[0] != self.n_vocab:
            raise ValueError(f"logits row has {row.shape[0]} entries, the vocabulary {self.n_vocab}")
        row[~self.allowed()] = -np.inf
        return row

    @property
    def done(self) -> bool:
        """The grammar is complete: an EOG token is allowed and nothing else is (computed from
        :meth:`allowed`: free after :meth:`mask`, one apply otherwise)."""
        ok = self.allowed()
        return bool(ok[self._eog].any()) and not bool(ok[~self._eog].any())

    # ---- advancing --------------------------------------------------------------------------------
    def accept(self, token: int) -> None:
        """Advance the grammar by ``token``; :class:`GrammarError` (state unchanged) if the grammar
        does not allow it.  An allowed EOG token changes nothing (as in llama.cpp)."""
        self._alive()
        token = int(token)
        if not self.allows(token):
            if not 0 <= token < self.n_vocab:
                raise GrammarError(f"token {token} is outside the vocabulary (0..{self.n_vocab - 1})")
            what = "end of generation" if self._eog[token] else "token"
            raise GrammarError(f"{what} {token} ({self._piece(token)!r}) is not allowed by the grammar here")
        if self._eog[token]:
            return
        # LLAMA_API void llama_sampler_accept(struct llama_sampler * smpl, llama_token token);
        ll.llama_sampler_accept(self._ptr, token)
        self._allowed = None
        self.n_accepted += 1

    def valid_prefix(self, tokens) -> int:
        """How many leading ``tokens`` the grammar accepts one after another (an allowed EOG token
        counts and ends the run).  Works on a clone: this state is unchanged."""
        toks = [int(t) for t in tokens]
        if not toks or not self.allows(toks[0]):
            return 0
        if self._eog[toks[0]] or len(toks) == 1:
            return 1
        with self.clone() as g:
            n = 0
            for t in toks:
                if not g.allows(t):
                    break
                n += 1
                if self._eog[t]:
                    break
                g.accept(t)
            return n

    def _piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(256)
        k = ll.llama_token_to_piece(self._target.vocab, token, buf, len(buf), 0, True)
        return buf.raw[:max(0, k)]


class GrammarCursor(Owned):
    """The grammar state of one sequence: the committed state, and a scratch clone advanced along
    the drafted block of the current step.  Owns the :class:`Grammar` it is given."""

    def __init__(self, grammar: Grammar):
        if not isinstance(grammar, Grammar):
            raise TypeError(f"GrammarCursor needs a Grammar, got {type(grammar).__name__}")
        grammar._alive()
        self.grammar = grammar            # the committed state
        self._scratch: Optional[Grammar] = None
        self._scratch_toks: List[int] = []
        self._scratch_n = 0
        self._eog = grammar._eog

    def commit(self, tokens) -> None:
        """Tokens emitted, in order (EOG tokens are skipped: generation ends there);
        :class:`GrammarError` at the first one the grammar rejects (those before it stay)."""
        self._drop_scratch()
        for t in tokens:
            t = int(t)
            if 0 <= t < len(self._eog) and self._eog[t]:
                continue
            self.grammar.accept(t)

    def state_after(self, extra: Sequence[int] = ()) -> Grammar:
        """The committed state advanced by ``extra`` (a drafted prefix).  Borrowed: valid until the
        next call or commit; query it, do not accept on it or close it.  Calls with growing
        prefixes of one block advance one scratch clone incrementally."""
        toks = [int(t) for t in extra]
        if not toks:
            return self.grammar
        n = len(self._eog)
        if any(0 <= t < n and self._eog[t] for t in toks[:-1]):
            raise GrammarError("a drafted prefix continues past an end-of-generation token")
        s = self._scratch
        k = len(self._scratch_toks)
        if (s is None or not s._ptr or s.n_accepted != self.grammar.n_accepted + self._scratch_n
                or k > len(toks) or toks[:k] != self._scratch_toks):
            self._drop_scratch()
            s = self._scratch = self.grammar.clone()
            k = 0
        for t in toks[k:]:
            try:
                s.accept(t)    # an allowed EOG (last) changes nothing
            except GrammarError:
                self._drop_scratch()
                raise
            self._scratch_toks.append(t)
            self._scratch_n += 0 if self._eog[t] else 1
        return s

    def _drop_scratch(self) -> None:
        if self._scratch is not None:
            self._scratch.close()
        self._scratch = None
        self._scratch_toks = []
        self._scratch_n = 0     # non-EOG tokens among them

    def close(self) -> None:
        if getattr(self, "grammar", None) is not None:
            self._drop_scratch()
            self.grammar.close()
