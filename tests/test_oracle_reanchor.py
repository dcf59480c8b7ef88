"""``-md oracle:P`` follows the *current* prefix (on a GPU, drafting changes greedy output
at near-ties, and an oracle that kept proposing the no-draft continuation never matched again).

A divergence is planted: the oracle's prepared reference is shifted by one token from position K
on, as if a near-tie had gone the other way there.  Then, at P = 1 (no planted errors):
* the output is still the target's own greedy output (``Llama``, the reference);
* reference mode re-anchors: after the divergence its blocks are accepted whole again (without
  re-anchoring, as before, nothing after K would be accepted);
* shadow mode (the GPU default; forced here) computes each block the way the verify does, so every
  block is accepted whole whatever the prepared reference says;
* the oracle's own decodes are kept out of the generation's time (``ms.hidden``)."""

from __future__ import annotations

import numpy as np
import pytest

from greedy_ref import TEST_THREADS
from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.speculative.drafter import DraftModelProposer
from pyllama_dspark.speculative.oracle import OracleDraft

N = 40
K = 9   # where the planted divergence starts (a generated token's index)


@pytest.fixture(scope="module")
def case(llama_refs):
    prompt = llama_refs.chat_tokens([{"role": "user", "content": "Write a haiku about rain."}])
    return prompt, llama_refs.greedy(prompt, N)


def _run(target_path, draft_path, prompt, mode, shift: bool):
    with Speculator(target_path, draft_path, n_threads=TEST_THREADS, n_max=7, schedule="off",
                    backend_sampling="off") as sp:
        oracle = OracleDraft(sp.target, DraftModelProposer(sp.draft), 1.0, mode=mode)
        sp.decoder.proposer = oracle
        oracle.prepare([prompt], N + 8)
        if shift:   # the reference after the K-th generated token leaves the greedy path
            o = oracle.set._by_prompt[tuple(prompt)]
            at = len(prompt) + K
            o.ref = np.concatenate([o.ref[:at], o.ref[at + 1:], o.ref[-1:]]).astype(np.int32)
        done = sp.generate(prompt, N)
        return done, oracle


@pytest.mark.parametrize("mode", ["reference", "shadow"])
def test_the_oracle_reanchors_after_a_divergence(mode, target_path, dspark_draft_path, case):
    prompt, ref = case
    done, oracle = _run(target_path, dspark_draft_path, prompt, mode, shift=True)
    st = done.stats
    assert done.tokens == ref
    assert oracle.n_reanchored >= 1
    # after the divergence every block is right again: at most the block that met it loses drafts
    lost = st.drafted - st.accepted
    assert lost <= 7, (st.drafted, st.accepted, st.verify_lengths, st.cycle_accepted)
    assert st.cycles <= N // 8 + 3
    assert st.ms_hidden > 0 and done.stats.as_dict()["ms"]["hidden"] > 0


def test_shadow_blocks_are_what_the_verify_computes(target_path, dspark_draft_path, case):
    prompt, ref = case
    done, oracle = _run(target_path, dspark_draft_path, prompt, "shadow", shift=False)
    st = done.stats
    assert done.tokens == ref
    assert st.accepted == st.drafted            # P = 1 and the verify's own argmax: nothing rejected
    assert oracle.n_shadow_decodes >= st.cycles - 1


def test_bad_mode_is_refused(target_path):
    with Speculator(target_path, None, n_ctx=256, n_threads=TEST_THREADS, schedule="off") as sp:
        with pytest.raises(ValueError, match="oracle mode"):
            OracleDraft(sp.target, None, 0.5, mode="sometimes")
