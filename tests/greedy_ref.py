"""Plain greedy decoding of the target through llama-cpp-python's ``Llama`` (the reference).

The decoding helpers are crosscheck's (users run the same comparison); tests add the settings.
:class:`LlamaRefs` (the session fixture ``llama_refs`` of conftest.py) computes each reference once
per test run, and :func:`check_near_tie_text` tells a numerical near-tie from a real divergence when
only the text of an output is known (the server's responses)."""

from __future__ import annotations

import copy
import os
import json
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from pyllama_dspark.measure.crosscheck import first_divergence, plain_greedy as greedy, top2_margin  # noqa: F401

# like-for-like with our defaults (llama-server's): flash attention on, n_ctx 4096, n_batch 512
LLAMA_KW = dict(n_ctx=4096, n_batch=512, n_ubatch=512, flash_attn=True, verbose=False)
# threads of every test's decodes (references and ours alike): CI runs the tests one at a time on 2
# cores; PYLLAMA_DSPARK_TEST_THREADS=1 on a machine shared with other jobs, where more threads than
# free cores make every decode crawl (llama-cpp-python's default would use every core for the
# prompt and half of them for generation)
TEST_THREADS = int(os.environ.get("PYLLAMA_DSPARK_TEST_THREADS", "2"))
# the shared greedy references decode token by token on one thread: measured, the same references
# on two threads differ from our two-thread batched verify by up to ~0.3 in a logit (two real
# divergences at margins 0.012 and 0.29 in 20 x 128 oracle tokens), on one thread they do not
REF_THREADS = 1


def open_llama(path: str):
    from llama_cpp import Llama

    return Llama(model_path=path, **LLAMA_KW)


def explain_mismatch(llm, prompt: Sequence[int], ours: Sequence[int], ref: Sequence[int], tie_eps: float) -> str:
    i = first_divergence(ours, ref)
    margin = top2_margin(llm, list(prompt) + list(ref[:i]))
    kind = "NUMERICAL NEAR-TIE" if margin < tie_eps else "REAL DIVERGENCE (bug)"
    return (f"{kind}: first divergence at generated token {i}: ours {ours[i] if i < len(ours) else None} "
            f"vs target {ref[i] if i < len(ref) else None}; target top-2 logit margin there {margin:.5f}")


class LlamaRefs:
    """Greedy references of the target through ``llama_cpp.Llama``, each computed once per run.

    ``greedy(prompt_tokens, n)``: token ids (``plain_greedy``: an EOG ends the list and is kept);
    a shorter request for a prompt already decoded further is a slice of that run (greedy decoding
    token by token is the same computation whatever the budget).  ``chat(messages, n)`` /
    ``completion(prompt, n)``: ``Llama.create_chat_completion`` / ``create_completion`` responses
    at temperature 0 from a fresh prefill; ``chat_tokens(messages)`` / ``completion_tokens(prompt)``
    the prompt token ids llama-cpp-python itself builds for them (chat template, BOS, specials).  ``top2(prefix)``: the best two tokens after
    ``prefix`` and their logit gap."""

    def __init__(self, path: str):
        self.path = path
        self._llm = None
        self._greedy: Dict[Tuple[int, ...], Tuple[int, List[int]]] = {}
        self._resp: Dict[str, object] = {}
        self._top2: Dict[Tuple[int, ...], Tuple[int, int, float]] = {}
        self.n_computed = 0
        self.n_reused = 0

    @property
    def llm(self):
        if self._llm is None:
            from llama_cpp import Llama

            self._llm = Llama(model_path=self.path, n_threads=REF_THREADS, n_threads_batch=REF_THREADS, **LLAMA_KW)
        return self._llm

    def close(self) -> None:
        if self._llm is not None:
            self._llm.close()
            self._llm = None

    # ---- token ids ---------------------------------------------------------------------------------
    def greedy(self, prompt: Sequence[int], n: int) -> List[int]:
        key = tuple(int(t) for t in prompt)
        hit = self._greedy.get(key)
        if hit is not None:
            n_done, toks = hit
            if n <= n_done or len(toks) < n_done:   # asked for less, or that run already ended (EOG)
                self.n_reused += 1
                return list(toks[:n])
        self.n_computed += 1
        toks = greedy(self.llm, key, n)
        self._greedy[key] = (n, list(toks))
        return list(toks)

    def top2(self, prefix: Sequence[int]) -> Tuple[int, int, float]:
        """(best, runner-up, logit gap) of the target's next-token logits after ``prefix``."""
        key = tuple(int(t) for t in prefix)
        if key not in self._top2:
            import llama_cpp

            llm = self.llm
            llm.reset()
            llm.eval(list(key))
            ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            row = np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float64)
            a, b = np.argsort(row)[-1], np.argsort(row)[-2]
            self._top2[key] = (int(a), int(b), float(row[a] - row[b]))
        return self._top2[key]

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        return self.llm.detokenize([int(t) for t in tokens])

    # ---- llama-cpp-python's own completion API -----------------------------------------------------
    def _call(self, kind: str, what, n: int, kw: dict, prompt_only: bool) -> Tuple[List[int], Optional[dict]]:
        """Run Llama.create_chat_completion / create_completion at temperature 0 from a fresh
        prefill; the prompt ids are those llama-cpp-python passes to ``Llama.generate``
        (``prompt_only``: stop right there, nothing is decoded)."""
        llm = self.llm
        seen: dict = {}
        orig = llm.generate

        class _Enough(Exception):
            pass

        def spy(tokens, *a, **k):
            seen["prompt"] = [int(t) for t in tokens]
            if prompt_only:
                raise _Enough
            return orig(tokens, *a, **k)

        llm.generate = spy
        try:
            llm.reset()
            if kind == "chat":
                r = llm.create_chat_completion(what, temperature=0.0, max_tokens=n, **kw)
            else:
                r = llm.create_completion(what, temperature=0.0, max_tokens=n, **kw)
        except _Enough:
            r = None
        finally:
            del llm.generate
        return seen["prompt"], r

    def _cached(self, key, fn):
        hit = self._resp.get(key)
        if hit is not None:
            self.n_reused += 1
            return hit
        self.n_computed += 1
        self._resp[key] = fn()
        return self._resp[key]

    def chat(self, messages, n: int, **kw) -> dict:
        key = json.dumps(["chat", messages, n, kw], sort_keys=True)
        return copy.deepcopy(self._cached(key, lambda: self._call("chat", messages, n, kw, False)[1]))

    def chat_tokens(self, messages) -> List[int]:
        key = json.dumps(["chat-prompt", messages], sort_keys=True)
        return list(self._cached(key, lambda: self._call("chat", messages, 1, {}, True)[0]))

    def completion(self, prompt, n: int, **kw) -> dict:
        key = json.dumps(["completion", prompt, n, kw], sort_keys=True)
        return copy.deepcopy(self._cached(key, lambda: self._call("completion", prompt, n, kw, False)[1]))

    def completion_tokens(self, prompt) -> List[int]:
        key = json.dumps(["completion-prompt", prompt], sort_keys=True)
        return list(self._cached(key, lambda: self._call("completion", prompt, 1, {}, True)[0]))


def check_near_tie_text(refs: LlamaRefs, prompt: Sequence[int], n: int, got: str, tie_eps: float,
                        prefix_ok: bool = False) -> Optional[str]:
    """Compare an output known only as text with the target's greedy continuation of ``prompt``.

    None when ``got`` is the text of the ``n`` reference tokens (``prefix_ok``: or a prefix of it,
    an output cut short).  Otherwise the first reference token whose text ``got`` does not
    continue is located; the divergence is excused -- a description is returned -- only when the
    target's top-2 logit gap there is below ``tie_eps`` *and* ``got`` continues with the runner-up
    token's text; anything else raises AssertionError (a real divergence)."""
    ref = refs.greedy(prompt, n)
    g = got.encode("utf-8")
    full = refs.detokenize(ref)
    if g == full or (prefix_ok and full.startswith(g)):
        return None
    i = 0
    while i < len(ref) and g.startswith(refs.detokenize(ref[: i + 1])):
        i += 1
    if i == len(ref):
        # every reference token's text is continued: got is longer than the reference
        raise AssertionError(f"REAL DIVERGENCE: the output {got!r} runs past the target's greedy text {full.decode(errors='replace')!r}")
    best, second, gap = refs.top2(list(prompt) + ref[:i])
    other = second if best == ref[i] else best   # a one-batch prefill may already rank them the other way
    where = (f"generated token {i}: target {ref[i]} {refs.detokenize([ref[i]])!r}, runner-up {other} "
             f"{refs.detokenize([other])!r}, top-2 logit gap {gap:.4f}")
    alt = refs.detokenize(ref[:i] + [other])
    took_runner_up = g.startswith(alt) or alt.startswith(g)
    if gap < tie_eps and took_runner_up:
        return "near-tie at " + where
    raise AssertionError(f"REAL DIVERGENCE at {where}; got {got!r}\nexpected {full.decode(errors='replace')!r}")
