"""A lazy grammar: unconstrained until a trigger appears in the output, constrained from there on.

llama-server's ``tool_choice: "auto"`` samples with a lazy grammar
(``llama_sampler_init_grammar_lazy_patterns``, ``src/llama-grammar.cpp``): while it awaits its
trigger every token is allowed and its text is buffered; a trigger *token* (a single special token
such as ``[TOOL_CALLS]``) starts the grammar with that token, a trigger *pattern* found in the buffer
starts it with the text from the match on (the tokens that overlap it are replayed into the
grammar, a partial piece included).  llama-cpp-python binds that sampler, but its replay runs
``llama_grammar_accept_token``, which throws through the C API (the process aborts) when the text
after the trigger does not fit the grammar, and a speculative loop must check drafts against the
state before accepting anything.  So the trigger logic runs here, over the strict sampler of
:class:`~.grammar.Grammar`:

* :class:`LazyGrammar` is a :class:`~.grammar.Grammar` (the loop, the sampler and
  :class:`~.grammar.GrammarCursor` use it unchanged): ``allows`` / ``allowed`` / ``mask`` allow
  everything while awaiting, ``accept`` buffers the piece and looks for a trigger;
* the replayed text is tokenized again and checked with :meth:`~.grammar.Grammar.valid_prefix`
  before it is accepted: a grammar matches code points, so any tokenization of the same text
  reaches the same state as llama.cpp's partial-piece replay;
* a trigger whose text the grammar rejects leaves the output unconstrained (llama.cpp would throw);
* ``think``: text inside a reasoning block (``<think>`` ... ``</think>``) is not searched, as
  llama-server's reasoning-budget sampler keeps the lazy grammar off there;
* ``at_start`` triggers fire only at the very start of the output (leading whitespace skipped).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

from pyllama_dspark.errors import ClosedError
from pyllama_dspark.llama.grammar import Grammar, GrammarError

__all__ = ["LazyGrammar"]


class LazyGrammar(Grammar):
    """A :class:`~.grammar.Grammar` that awaits a trigger (module doc).  ``words``: trigger texts;
    ``tokens``: trigger token ids; ``at_start``: the words count only at the start of the output."""

    def __init__(self, proto: Grammar, words: Sequence[str] = (), tokens: Sequence[int] = (), *,
                 at_start: bool = False, think: Optional[Tuple[str, str]] = None):   # use compile()
        self._proto = proto                  # the strict grammar in its initial state (owned)
        self._strict: Optional[Grammar] = None
        self._target = proto._target
        self.gbnf, self.root = proto.gbnf, proto.root
        self.n_vocab = proto.n_vocab
        self._eog = proto._eog
        self._allowed = None
        self.n_accepted = 0
        self.words, self.tokens = tuple(words), frozenset(int(t) for t in tokens)
        self.at_start, self.think = bool(at_start), think
        self._buf = ""
        self._failed = False                 # a trigger the grammar rejected: unconstrained from then on
        self._longest = max((len(w) for w in self.words), default=0)

    @classmethod
    def compile(cls, gbnf: str, target, root: str = "root", *, words: Sequence[str] = (), tokens: Sequence[int] = (),
                at_start: bool = False, think: Optional[Tuple[str, str]] = None) -> "LazyGrammar":
        if not words and not tokens:
            raise GrammarError("a lazy grammar needs at least one trigger word or token")
        return cls(Grammar.compile(gbnf, target, root), words, tokens, at_start=at_start, think=think)

    # ---- state ------------------------------------------------------------------------------------
    @property
    def _ptr(self):   # GrammarCursor checks a scratch state's pointer
        p = getattr(self, "_proto", None)
        return None if p is None else p._ptr

    @property
    def triggered(self) -> bool:
        return self._strict is not None

    @property
    def awaiting(self) -> bool:
        return self._strict is None and not self._failed

    def _alive(self):
        if getattr(self, "_proto", None) is None or not self._proto._ptr:
            raise ClosedError("grammar is closed")
        self._proto._alive()

    def close(self) -> None:
        for name in ("_strict", "_proto"):
            g = getattr(self, name, None)
            if g is not None:
                g.close()
        self._strict = None

    def clone(self) -> "LazyGrammar":
        self._alive()
        g = LazyGrammar(self._proto.clone(), self.words, (), at_start=self.at_start, think=self.think)
        g.tokens = self.tokens
        g._strict = None if self._strict is None else self._strict.clone()
        g._buf, g._failed, g.n_accepted = self._buf, self._failed, self.n_accepted
        return g

    # ---- queries ----------------------------------------------------------------------------------
    def allowed(self) -> np.ndarray:
        self._alive()
        if self._strict is not None:
            return self._strict.allowed()
        if self._allowed is None:
            ok = np.ones(self.n_vocab, dtype=bool)
            ok.flags.writeable = False
            self._allowed = ok
        return self._allowed

    def allows(self, token: int) -> bool:
        self._alive()
        if self._strict is not None:
            return self._strict.allows(token)
        return 0 <= int(token) < self.n_vocab

    @property
    def done(self) -> bool:
        return self._strict is not None and self._strict.done

    # ---- advancing --------------------------------------------------------------------------------
    def accept(self, token: int) -> None:
        self._alive()
        token = int(token)
        if self._strict is not None:
            self._strict.accept(token)      # GrammarError (state unchanged) when not allowed
            if not self._eog[token]:
                self.n_accepted += 1
            return
        if not 0 <= token < self.n_vocab:
            raise GrammarError(f"token {token} is outside the vocabulary (0..{self.n_vocab - 1})")
        if self._eog[token]:
            return
        self.n_accepted += 1
        if self._failed:
            return
        before = len(self._buf)
        self._buf += self._piece(token).decode("utf-8", "replace")
        if token in self.tokens and not (self.think is not None and self._in_think(before)):
            self._start([token])
            return
        pos = self._find(before)
        if pos is not None:
            self._start(self._target.tokenize(self._buf[pos:], False, True))

    def _find(self, before: int) -> Optional[int]:
        """Where a trigger word starts in the buffer (a match that ends in the new piece), or None."""
        buf = self._buf
        if self.at_start:
            stripped = buf.lstrip()
            for w in self.words:
                if stripped.startswith(w):
                    return len(buf) - len(stripped)
            if stripped and not any(w.startswith(stripped) for w in self.words):
                self._failed = True     # the output started otherwise: no trigger can come any more
            return None
        lo = max(0, before - self._longest + 1)
        best = None
        for w in self.words:
            i = buf.find(w, lo)
            while i >= 0 and self.think is not None and self._in_think(i):
                i = buf.find(w, i + 1)
            if i >= 0 and (best is None or i < best):
                best = i
        return best

    def _in_think(self, i: int) -> bool:
        open_, close = self.think
        o = self._buf.rfind(open_, 0, i)
        return o >= 0 and self._buf.find(close, o, i) < 0

    def _start(self, replay: Sequence[int]) -> None:
        """Trigger: the strict grammar from its initial state, advanced by ``replay`` if it fits
        (else the output stays unconstrained: llama.cpp would throw)."""
        g = self._proto.clone()
        try:
            ok = g.valid_prefix(replay) == len(replay)
            if ok:
                for t in replay:
                    g.accept(t)
        except BaseException:
            g.close()
            raise
        if not ok:
            g.close()
            self._failed = True
            return
        self._strict = g
        self._buf = ""
        self._allowed = None
