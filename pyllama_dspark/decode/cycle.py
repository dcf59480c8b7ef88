"""The pieces of one speculative cycle besides the loop itself (:mod:`.loop`): the prompt check,
the events a generation yields (:class:`Started`, :class:`Chunk` per cycle, one :class:`Done`),
its :class:`Stats`, incremental detokenization with stop strings (:class:`TextStream` over a
:class:`PieceCache`), and the verify rows the sampled accept rule reads lazily
(:class:`OneHotRows` for a deterministic draft's q, :class:`TargetRows` for the target's p through
the sampler chain)."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import numpy as np

from pyllama_dspark.errors import ContextOverflowError
from pyllama_dspark.llama.handles import Target
from pyllama_dspark.speculative.sampling import Dist, TokenSampler


@dataclass
class Stats:
    n_prompt: int = 0
    n_cached: int = 0                    # prompt tokens the memories already held (prompt cache)
    n_generated: int = 0
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    near_ties: int = 0                   # verify rows whose top-2 logit gap was below tie_eps
    pos_drafted: List[int] = field(default_factory=list)   # position k reached (prefix accepted)
    pos_accepted: List[int] = field(default_factory=list)
    verify_lengths: List[int] = field(default_factory=list)   # drafts verified per cycle
    cycle_accepted: List[int] = field(default_factory=list)   # drafts accepted per cycle
    ms_prefill: float = 0.0
    ms_draft: float = 0.0
    ms_verify: float = 0.0
    ms_inject: float = 0.0
    ms_sample: float = 0.0               # T > 0: target sampler chain + accept/resample (draft's is in ms_draft)
    seed: Optional[int] = None           # T > 0: the seed the generation used (resolved if it was random)
    ms_total: float = 0.0                # generation phase (after prefill)
    ms_llama: float = 0.0                # of ms_total: inside llama.cpp's decodes (this request's share)
    ms_hidden: float = 0.0               # a proposer's own work kept out of ms_total (the oracle's truth)
    schedule: Optional[str] = None       # what the verification schedule chose, and why (one line)

    def record(self, n_drafted: int, n_acc: int) -> None:
        self.cycles += 1
        self.drafted += n_drafted
        self.accepted += n_acc
        self.verify_lengths.append(n_drafted)
        self.cycle_accepted.append(n_acc)
        while len(self.pos_drafted) < n_drafted:
            self.pos_drafted.append(0)
            self.pos_accepted.append(0)
        # position k is "tried" when all earlier ones were accepted (conditional acceptance)
        for k in range(min(n_acc + 1, n_drafted)):
            self.pos_drafted[k] += 1
        for k in range(n_acc):
            self.pos_accepted[k] += 1

    @property
    def tau(self) -> float:
        return (self.accepted + self.cycles) / self.cycles if self.cycles else 0.0

    @property
    def accept_per_position(self) -> List[float]:
        return [a / d if d else 0.0 for a, d in zip(self.pos_accepted, self.pos_drafted)]

    @property
    def ms_overhead(self) -> float:
        return max(0.0, self.ms_total - self.ms_draft - self.ms_verify - self.ms_inject - self.ms_sample)

    @property
    def ms_host(self) -> float:
        """The host's own work: the generation's time outside llama.cpp's decodes (our loop, the
        readbacks, the accept rule, the bookkeeping and the caller's handling of each cycle)."""
        return max(0.0, self.ms_total - self.ms_llama)

    @property
    def tokens_per_second(self) -> float:
        return self.n_generated / (self.ms_total / 1e3) if self.ms_total > 0 else 0.0

    def as_dict(self) -> dict:
        d = self._as_dict()
        if self.seed is not None:
            d["seed"] = self.seed
        if self.schedule is not None:
            d["schedule"] = self.schedule
        return d

    def _as_dict(self) -> dict:
        return {
            "n_prompt": self.n_prompt,
            "n_generated": self.n_generated,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tau": round(self.tau, 4),
            "cycles": self.cycles,
            "near_ties": self.near_ties,
            "tokens_per_second": round(self.tokens_per_second, 3),
            "accept_per_position": [round(x, 4) for x in self.accept_per_position],
            "ms": {
                "prefill": round(self.ms_prefill, 3),
                "draft": round(self.ms_draft, 3),
                "verify": round(self.ms_verify, 3),
                "inject": round(self.ms_inject, 3),
                "sample": round(self.ms_sample, 3),
                "overhead": round(self.ms_overhead, 3),
                "total": round(self.ms_total, 3),
                "llama": round(self.ms_llama, 3),
                "host": round(self.ms_host, 3),
                "host_per_cycle": round(self.ms_host / self.cycles, 4) if self.cycles else 0.0,
                **({"hidden": round(self.ms_hidden, 3)} if self.ms_hidden else {}),
            },
        }

    def summary(self) -> str:
        per = " ".join(f"{x:.2f}" for x in self.accept_per_position)
        c = max(self.cycles, 1)
        return (f"prompt {self.n_prompt} tok, generated {self.n_generated} tok in {self.ms_total:.1f} ms "
                f"({self.tokens_per_second:.2f} tok/s); cycles {self.cycles}, drafted {self.drafted}, "
                f"accepted {self.accepted}, tau {self.tau:.3f}; per-position acceptance [{per}]; "
                f"ms/cycle draft {self.ms_draft / c:.2f} verify {self.ms_verify / c:.2f} "
                f"inject {self.ms_inject / c:.2f} "
                + (f"sample {self.ms_sample / c:.2f} " if self.ms_sample else "")
                + f"overhead {self.ms_overhead / c:.3f}, host {self.ms_host / c:.3f}")


@dataclass
class Chunk:
    """Tokens emitted by one cycle and the text they completed (held back near stop strings);
    ``probs``: one :class:`~..speculative.logprobs.TokenProb` per token when the request asked for them.
    ``trace`` (a request with ``trace``): per cycle whose tokens these are, ``(cycle, drafted,
    verified, accepted, n_tokens)``; a cycle's first ``min(accepted, n_tokens)`` tokens are accepted
    drafts, the rest the target's own (the prefill's token is cycle 0, ``(0, 0, 0, 0, 1)``).  ``timings``: the
    request's llama-server ``timings`` so far (with ``trace``)."""
    tokens: List[int]
    text: str
    probs: Optional[list] = None
    trace: Optional[list] = None
    timings: Optional[dict] = None


@dataclass
class Started:
    """Streaming event: the request got sequence slot ``slot`` and its prompt was decoded."""
    slot: int


@dataclass
class Done:
    tokens: List[int]
    text: str
    finish_reason: str  # "stop" (EOG or stop string) or "length"
    stats: Stats
    stop_word: Optional[str] = None   # the stop string that ended it (None: EOG, length or cancel)
    probs: Optional[list] = None      # TokenProb per token of ``tokens``, when asked for


def check_prompt(prompt: Sequence[int], n_vocab: int, n_ctx: int) -> np.ndarray:
    """Token ids as int32, or a clear exception (llama.cpp aborts on ids outside the vocabulary)."""
    ids = list(prompt)
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) for t in ids):
        raise TypeError("prompt token ids must be integers")
    if not ids:
        raise ValueError("the prompt is empty")
    if min(ids) < 0 or max(ids) >= n_vocab:
        raise ValueError(f"prompt token ids must be in 0..{n_vocab - 1}")
    toks = np.asarray(ids, dtype=np.int32)
    if toks.size + 1 > n_ctx:
        raise ContextOverflowError(f"prompt of {toks.size} tokens does not fit the context of {n_ctx} tokens")
    return toks


class PieceCache(dict):
    """token id -> its text piece (bytes) on one target, asked from llama.cpp once per token."""

    def __init__(self, target: Target):
        super().__init__()
        self.target = target

    def __missing__(self, token: int) -> bytes:
        piece = self[token] = self.target.token_to_piece(token)
        return piece


class TextStream:
    """Incremental UTF-8 detokenization with stop strings; never emits text past a stop string,
    and holds back only an end of the text that begins one (a first token goes out at once)."""

    def __init__(self, pieces: PieceCache, stop: Sequence[str]):
        self.pieces = pieces
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.sent = 0
        self.stopped = False
        self.stop_word: Optional[str] = None

    def push(self, token: int) -> None:
        self.text += self.dec.decode(self.pieces[token])
        self._find_stop()

    def _find_stop(self) -> None:
        if self.stop:
            start = max(0, self.sent - self.hold - 1)
            hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
            if hits:
                i, self.stop_word = min(hits)
                self.text = self.text[:i]
                self.stopped = True

    def flush(self, final: bool = False) -> str:
        if final and not self.stopped:
            # an incomplete UTF-8 sequence held back at the end becomes U+FFFD, which may complete
            # a stop string like any other text
            self.text += self.dec.decode(b"", final=True)
            self._find_stop()
        end = len(self.text) if (final or self.stopped) else max(self.sent, len(self.text) - self._partial())
        out = self.text[self.sent:end]
        self.sent = end
        return out

    def _partial(self) -> int:
        """Length of the longest end of the unsent text that begins a stop string: what is held
        back (llama-server's ``find_partial_stop_string``); the rest can never be part of one."""
        t, best = self.text, 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(t) - self.sent), best, -1):
                if t.endswith(s[:k]):
                    best = k
                    break
        return best


class OneHotRows:
    """q rows of a deterministic proposal: one-hot at each drafted token (sparse, built on demand)."""

    def __init__(self, tokens: np.ndarray, n_vocab: int):
        self.tokens = tokens
        self.n_vocab = n_vocab

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i: int) -> Dist:
        return Dist.one_hot(self.tokens[i], self.n_vocab)


class TargetRows:
    """p rows of the verify decode through the sampler chain, computed on first use (sparse
    :class:`~.sampling.Dist` rows: the C chain reads the logits in place, nothing vocabulary-sized
    is built).

    Row i (of this sequence's rows, which start at ``row0`` of the decode) follows the anchor and
    drafts[:i]: the penalty history is extended with drafts[:i]."""

    def __init__(self, target: Target, smp: TokenSampler, drafts: np.ndarray, row0: int = 0):
        self.target = target
        self.smp = smp
        self.drafts = drafts
        self.row0 = row0

    def __getitem__(self, i: int) -> np.ndarray:
        return self.smp.probs(self.target.logits_view(self.row0 + i), self.drafts[:i])
