"""One request of the loop (:mod:`.loop`): its record (:class:`Request`), how it is built and
checked (:func:`make_request`), the grammar cut of its drafted block (:func:`grammar_cut`) and
its token probabilities (:func:`token_probs`).

A request needs a :class:`~..speculative.sampling.TokenSampler` (the sampled accept path) when it samples
(T > 0), or at T = 0 when its greedy pick is not the plain argmax of the target's row: penalties,
a logit bias or a grammar.  Its rows are then one-hot at the penalized / biased / constrained
argmax, and the accept rule reduces to "draft == that argmax".
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import numpy as np

from pyllama_dspark.decode.cycle import Stats, TextStream, check_prompt
from pyllama_dspark.decode.timings import llama_timings
from pyllama_dspark.speculative import logprobs as lp
from pyllama_dspark.speculative.dist import Dist
from pyllama_dspark.speculative.drafter import check_n_max
from pyllama_dspark.speculative.sampling import SamplingParams, TokenSampler


@dataclass
class Request:
    rid: int
    prompt: np.ndarray
    max_tokens: int
    n_max: int
    text: TextStream
    smp: Optional[TokenSampler] = None
    ignore_eos: bool = False
    reuse: bool = False
    n_probs: int = 0                 # > 0: a TokenProb per emitted token
    post_probs: bool = False         # ... from the sampler chain instead of the raw softmax
    seq_id: int = -1
    out: List[int] = field(default_factory=list)
    pending: List[int] = field(default_factory=list)   # emitted, not yet handed out
    probs: List[lp.TokenProb] = field(default_factory=list)
    pending_probs: List[lp.TokenProb] = field(default_factory=list)
    anchor: int = 0
    pos0: int = 0
    finish: Optional[str] = None
    stats: Stats = field(default_factory=Stats)
    t_start: float = 0.0
    # trace: per cycle not yet handed out, (drafted, verified, accepted, tokens emitted); None: off
    trace: Optional[List[tuple]] = None


def check_logit_bias(logit_bias, n_vocab: int) -> Optional[dict]:
    """``{token id: bias}`` with int ids in range and float biases (-inf allowed), or an error."""
    if not logit_bias:
        return None
    if not isinstance(logit_bias, dict):
        raise TypeError("logit_bias must be a dict {token id: bias}")
    out = {}
    for t, b in logit_bias.items():
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= int(t) < n_vocab:
            raise ValueError(f"logit_bias token ids must be integers in 0..{n_vocab - 1}, got {t!r}")
        if isinstance(b, bool) or not isinstance(b, (int, float, np.floating, np.integer)) or b != b or b == np.inf:
            raise ValueError(f"logit_bias values must be finite numbers or -inf, got {b!r}")
        out[int(t)] = float(b)
    return out


def make_grammar(grammar, target):
    """A :class:`~..llama.grammar.GrammarCursor` for a GBNF string or a compiled Grammar (None: none)."""
    if grammar is None:
        return None
    from pyllama_dspark.llama.grammar import Grammar, GrammarCursor

    if isinstance(grammar, str):
        grammar = Grammar.compile(grammar, target)
    elif isinstance(grammar, Grammar):
        grammar = grammar.clone()
    else:
        raise TypeError(f"grammar must be a GBNF string or a Grammar, got {type(grammar).__name__}")
    return GrammarCursor(grammar)


def make_request(rid: int, target, pieces, eog: np.ndarray, n_ctx_seq: int, max_draft: int, prompt: Sequence[int],
                 max_tokens: int, stop: Sequence[str], *, sampling: Optional[SamplingParams], ignore_eos: bool,
                 n_max: Optional[int], reuse_prefix: bool, grammar=None, logit_bias=None, n_probs: int = 0,
                 post_sampling_probs: bool = False, trace: bool = False, draft: bool = True) -> Request:
    """A checked request (see :meth:`~.loop.Decoder.submit` for the arguments)."""
    toks = check_prompt(prompt, target.n_vocab, n_ctx_seq)
    if isinstance(max_tokens, bool) or int(max_tokens) <= 0:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if isinstance(stop, str) or not all(isinstance(s, str) for s in stop):
        raise TypeError("stop must be a sequence of strings")
    if not all(stop):
        raise ValueError("stop strings must be non-empty (an empty one would match before any text)")
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
    if isinstance(n_probs, bool) or not isinstance(n_probs, (int, np.integer)) or n_probs < 0:
        raise ValueError(f"n_probs must be an integer >= 0, got {n_probs!r}")
    bias = check_logit_bias(logit_bias, target.n_vocab)
    n = max_draft if n_max is None else min(check_n_max(n_max), max_draft)
    if not draft:   # this request drafts nothing (serve's per-request "speculative.n_max": 0)
        n = 0
    smp = None
    greedy_argmax = sampling is None or (sampling.is_greedy and not sampling.has_penalties)
    if not greedy_argmax or bias or grammar is not None:
        # like llama.cpp's --ignore-eos at T > 0: end-of-generation tokens get a -inf logit bias
        banned = np.flatnonzero(eog) if ignore_eos else None
        cursor = make_grammar(grammar, target)
        smp = TokenSampler(sampling or SamplingParams.greedy(), toks.tolist(), banned=banned, logit_bias=bias,
                           grammar=cursor)
    s = Request(rid, toks, int(max_tokens), n, TextStream(pieces, stop), smp=smp, ignore_eos=ignore_eos,
                reuse=bool(reuse_prefix), n_probs=int(n_probs), post_probs=bool(post_sampling_probs))
    s.stats.seed = None if smp is None else smp.seed
    s.trace = [] if trace else None
    return s


def chunk_trace(s: Request) -> tuple:
    """A streamed chunk's ``(trace, timings)`` (:class:`~.cycle.Chunk`): the cycles not yet handed
    out and the request's ``timings`` so far; ``(None, None)`` for a request without ``trace``."""
    if s.trace is None:
        return None, None
    trace, s.trace = s.trace, []
    st = copy.copy(s.stats)
    st.n_generated = len(s.out)
    st.ms_total = (time.perf_counter() - s.t_start) * 1e3 - st.ms_prefill - st.ms_hidden
    return trace, llama_timings(st)


def device_greedy(s: Request) -> bool:
    """Whether the request's verify rows can be read out on the device (their argmax and top-2 gap,
    no logits row): greedy, with no sampler state (penalties, bias, grammar) and no log-probs."""
    return s.smp is None and not s.n_probs


def grammar_cut(smp: TokenSampler, drafts: np.ndarray, q_rows, n_vocab: int):
    """Cut a drafted block before its first token the request's grammar rejects: (the kept
    drafts, the distribution the cut draft was drawn from, or None when nothing was cut)."""
    n_ok = smp.grammar.state_after(()).valid_prefix(drafts)
    if n_ok >= len(drafts):
        return drafts, None
    q = q_rows[n_ok] if q_rows is not None else Dist.one_hot(int(drafts[n_ok]), n_vocab)
    return drafts[:n_ok], q


def token_probs(s: Request, target, row0: int, tokens: Sequence[int], row: Optional[np.ndarray] = None,
                extra_base: Sequence[int] = ()) -> List[lp.TokenProb]:
    """A TokenProb for each of ``tokens``, token j read from the target's output row row0 + j
    (or from ``row`` for a single token), the sequence before it being ``extra_base`` + tokens[:j]
    (the state the sampler chain saw).  Call before the sampler commits ``tokens``."""
    out = []
    for j, t in enumerate(tokens):
        x = row if row is not None else target.logits_view(row0 + j)
        if not s.post_probs:
            out.append(lp.pre_sampling(x, t, s.n_probs))
        elif s.smp is None:
            out.append(lp.one_hot(t))
        else:
            d = s.smp.probs(x, list(extra_base) + [int(v) for v in tokens[:j]])
            out.append(lp.post_sampling(d.ids, d.probs, t, s.n_probs))
    return out
