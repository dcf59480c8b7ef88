"""The DSpark draft at T > 0 is semi-autoregressive: position k is conditioned on the token
actually *sampled* at k-1, not on llama.cpp's in-graph argmax.

On a real block decode of the random DSpark draft (SmolLM2 target features injected), the
proposer's block sampler draws (x1, x2) many times.  The expected joint law is computed here
independently of the shim's Markov graph, from the GGUF weights in numpy:

    q1 = chain(row_0)                                   (row 0 is conditioned on the anchor)
    q2(. | x1) = chain(row_1 - W2.W1[a_0] + W2.W1[x1])  (a_0 = argmax of row 0)

A chi-square test over the (x1, x2) cells must accept the sampled-token chain, and must reject
llama.cpp's argmax conditioning (``conditioning="argmax"``, the deliberately broken variant):
that is the proof the test can tell the two apart.
"""

from __future__ import annotations

import numpy as np
import pytest

from pyllama_dspark.speculative.drafter import DraftModelProposer
from pyllama_dspark.gguf.reader import read_gguf
from pyllama_dspark.llama.handles import ContextSettings, Draft, Target
from pyllama_dspark.speculative.chain import chain_probs
from pyllama_dspark.speculative.sampling import TokenSampler
from pyllama_dspark.speculative.sampling_params import SamplingParams
from pyllama_dspark.gguf.info import read_draft_info
from test_sampling_rule import chi2_pvalue

N_DRAWS = 20_000
PARAMS = SamplingParams(temperature=1.5, top_k=8, top_p=1.0, min_p=0.0, seed=11)


def _markov_numpy(path):
    t = {x.name: x for x in read_gguf(path).tensors}
    w1 = np.asarray(t["markov_w1.weight"].data, dtype=np.float64)     # [n_vocab, R]
    w2 = np.asarray(t["markov_w2.weight"].data, dtype=np.float64)     # [n_vocab_draft, R]
    conf = np.asarray(t["conf_proj.weight"].data, dtype=np.float64).reshape(-1)
    b = float(np.asarray(t["conf_proj.bias"].data).reshape(-1)[0])
    return w1, w2, conf, b


@pytest.fixture(scope="module")
def block(target_path, dspark_draft_path):
    info = read_draft_info(dspark_draft_path)
    settings = ContextSettings(n_threads=1, n_ctx=512)
    with Target(target_path, settings, capture_layers=info.target_layer_ids) as tgt:
        draft = Draft(dspark_draft_path, tgt, settings)
        prop = DraftModelProposer(draft)
        toks = np.asarray(tgt.tokenize("The quick brown fox jumps over the lazy"), dtype=np.int32)
        tgt.decode(toks, 0, 0, all_outputs=False)
        prop.observe(0, len(toks), 0)
        anchor = int(toks[-1])
        blk = np.full(2, draft.meta.mask_token_id, dtype=np.int32)
        blk[0] = anchor
        pos0 = len(toks)  # the anchor re-used at the next position: any context works here
        draft.decode_block(blk, pos0, 0, hidden=True)
        rows = np.stack([draft.logits(0), draft.logits(1)])
        yield tgt, draft, prop, anchor, rows
        prop.close()


def _draw(prop, anchor, conditioning, n):
    bs = prop.block_sampler
    bs.conditioning = conditioning
    smp = TokenSampler(PARAMS)
    pairs = np.empty((n, 2), dtype=np.int64)
    q2_seen = {}
    confs = {}
    for i in range(n):
        toks, q, conf = bs.sample(0, 2, smp)
        pairs[i] = toks
        q2_seen.setdefault(int(toks[0]), q[1])
        confs.setdefault(int(toks[0]), conf.copy())
    return pairs, q2_seen, confs


def _expected(rows, anchor, w1, w2):
    v = rows.shape[1]
    q1 = chain_probs(rows[0], PARAMS)
    a0 = int(np.argmax(rows[0]))
    u1 = rows[1].astype(np.float64) - w2 @ w1[a0]     # recover U_1 from llama.cpp's argmax-biased row
    joint = np.zeros((v, v))
    cond = {}
    for x1 in np.flatnonzero(q1):
        cond[int(x1)] = chain_probs((u1 + w2 @ w1[x1]).astype(np.float32), PARAMS)
        joint[x1] = q1[x1] * cond[int(x1)]
    return q1, a0, joint, cond


@pytest.mark.parametrize("conditioning, holds", [("sampled", True), ("argmax", False)])
def test_second_position_follows_the_sampled_token(block, dspark_draft_path, conditioning, holds):
    tgt, draft, prop, anchor, rows = block
    w1, w2, _, _ = _markov_numpy(dspark_draft_path)
    q1, a0, joint, cond = _expected(rows, anchor, w1, w2)
    # the test needs power: x1 must often differ from the argmax, and the bias must matter
    assert q1[a0] < 0.8, f"row 0 too peaked ({q1[a0]:.3f}) to exercise the conditioning"
    tv = max(0.5 * np.abs(cond[x] - cond[a0]).sum() for x in cond)
    assert tv > 0.2, f"the Markov bias barely moves q2 (max TV {tv:.3f}); the test would have no power"

    pairs, q2_seen, _ = _draw(prop, anchor, conditioning, N_DRAWS)
    v = rows.shape[1]
    cells = np.flatnonzero(joint.ravel() > 0)
    flat = pairs[:, 0] * v + pairs[:, 1]
    if holds:
        assert np.isin(flat, cells).all(), "a pair outside the expected support was drawn"
    else:
        flat = flat[np.isin(flat, cells)]  # the broken chain may leave the support: count what is inside
    counts = np.bincount(np.searchsorted(cells, flat), minlength=cells.size)
    pv = chi2_pvalue(counts, joint.ravel()[cells] / joint.ravel()[cells].sum())
    share = float(np.mean(pairs[:, 0] != a0))
    print(f"\n{conditioning}: {N_DRAWS} draws, x1 != argmax in {share:.1%}, {cells.size} cells, chi-square p = {pv:.3g}")
    if holds:
        assert pv > 1e-3
        # and the q rows it reports are the conditional it drew from (to float32 rounding)
        for x1, q2 in q2_seen.items():
            np.testing.assert_allclose(q2, cond[x1], atol=2e-5)
    else:
        assert pv < 1e-6, "the argmax-conditioned chain passed: the test cannot see the conditioning"


def test_confidence_uses_the_sampled_token(block, dspark_draft_path):
    tgt, draft, prop, anchor, rows = block
    w1, w2, conf_w, b = _markov_numpy(dspark_draft_path)
    n_embd = draft.n_embd
    graph = np.zeros(2, dtype=np.float32)
    draft.confidence(0, 2, graph)   # llama.cpp's: position 2 conditioned on the argmax
    a0 = int(np.argmax(rows[0]))
    h1 = draft.hidden(1).astype(np.float64)

    def sigma(prev):
        return 1.0 / (1.0 + np.exp(-(conf_w[:n_embd] @ h1 + conf_w[n_embd:] @ w1[prev] + b)))

    assert abs(sigma(a0) - graph[1]) < 1e-4, "h_1 / weights do not reproduce llama.cpp's confidence"
    _, _, confs = _draw(prop, anchor, "sampled", 300)
    assert len(confs) > 1
    for x1, c in confs.items():
        assert abs(c[0] - graph[0]) < 1e-6              # position 1 is conditioned on the anchor
        assert abs(c[1] - sigma(x1)) < 1e-4, (x1, c[1], sigma(x1))
    assert any(abs(c[1] - graph[1]) > 1e-3 for x1, c in confs.items() if x1 != a0)


def test_bias_delta_scatters_reduced_vocab_rows():
    from pyllama_dspark.speculative.draft_sampling import bias_delta

    a, x = np.array([1.0, 2.0, 3.0], dtype=np.float32), np.array([0.5, 4.0, 3.0], dtype=np.float32)
    np.testing.assert_array_equal(bias_delta(a, x, None, 3), [-0.5, 2.0, 0.0])
    d2t = np.array([7, 2, 4])
    np.testing.assert_array_equal(bias_delta(a, x, d2t, 8), [0, 0, 2.0, 0, 0, 0, 0, -0.5])
    with pytest.raises(ValueError):
        bias_delta(a, x, None, 8)
    with pytest.raises(ValueError):
        bias_delta(a, x, np.array([1, 2]), 8)
