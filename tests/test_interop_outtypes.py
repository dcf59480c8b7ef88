"""``convert --outtype bf16 / q8_0`` of the shipped drafter: lossless decoding, and block
logits within a stated tolerance of the f32 conversion.

The shipped SmolLM2 drafter (F16 matrices, F32 fc, reduced vocabulary with d2t) is exported once and
converted to f32, bf16 and q8_0.  References: ``llama_cpp.Llama`` greedy (drafting forced must not
change a token), and the f32 conversion's logits for the same injected target features and the same
block (each draft is attached in turn to one target context that decoded the prompt once).

Tolerance: weight rounding scales every logit error with the format's relative rounding unit ``u``
and the size of the logits, so the bound is ``max |logit - logit_f32| <= K * u * R`` per prompt, with
``R`` the smallest spread (max - min over the draft vocabulary) of a block row, ``u`` = 2^-11 (f16),
2^-8 (bf16) and 3/254 for q8_0 (a Q8_0 block stores round(127 w / max|w|): half a step is max|w|/254,
and the block maximum of 32 roughly Gaussian weights is about 3 typical weights), and K = 4.
Measured on the two prompts below (1 thread, CPU): max |d| / (u R) up to 0.85 (f16), 0.75 (bf16) and
1.23 (q8_0), i.e. 0.008, 0.056 and 0.28 in logits against row spreads of ~20; K = 4 leaves room for other
CPUs' kernels and stays an order of magnitude below what a wrongly typed or transposed tensor gives.
On an AVX2-only CPU (no AVX-512) llama.cpp's bf16 kernels measured max |d| / (u R) = 13.6 (one
element: 1.17 in a logit, mean |d| 0.021) while f16 stayed at 0.52, so bf16's K is 16: 1.4 in a logit
against spreads of ~20, still over an order of magnitude below a wrong tensor's error.
"""

from __future__ import annotations

import numpy as np
import pytest

from pyllama_dspark.gguf.reader import read_gguf
from pyllama_dspark.interop.convert import convert_checkpoint
from pyllama_dspark.interop.export import export_checkpoint
from pyllama_dspark.paths import default_draft

PROMPTS = ("Write a short poem about the sea.", "Explain what a hash table is in two sentences.")
N_TOK = 32
UNIT = {"f16": 2.0 ** -11, "bf16": 2.0 ** -8, "q8_0": 3 / 254}
K = 4.0
K_TYPE = {"bf16": 16.0}   # see the module docstring: the bf16 kernels of AVX2-only CPUs


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, target_path):
    """outtype -> draft GGUF ("f16" is the shipped file itself)."""
    d = tmp_path_factory.mktemp("outtypes")
    ck = export_checkpoint(default_draft(), d / "ck")
    out = {"f16": default_draft()}
    for o in ("f32", "bf16", "q8_0"):
        out[o] = convert_checkpoint(ck, target_path, d / f"{o}.gguf", outtype=o)
    return out


def test_outtypes_write_the_requested_types(drafts):
    for o in ("f32", "bf16", "q8_0"):
        types = {t.name: t.tensor_type.name for t in read_gguf(drafts[o], use_cache=False).tensors}
        assert types["blk.0.attn_q.weight"] == o.upper() and types["output.weight"] == o.upper()
        assert types["fc.weight"] == "F32" and types["blk.0.attn_norm.weight"] == "F32"
        assert types["d2t"] == "I64"


@pytest.mark.parametrize("outtype", ["bf16", "q8_0"])
def test_bf16_and_q8_0_drafts_decode_losslessly(outtype, drafts, target_path, llama_refs):
    from pyllama_dspark.decode.api import Speculator

    drafted = 0
    with Speculator(target_path, drafts[outtype], n_ctx=512, n_threads=1, schedule="off") as sp:
        for msg in PROMPTS:
            prompt = list(sp.chat_prompt([{"role": "user", "content": msg}]).tokens)
            done = sp.generate(prompt, N_TOK)
            assert list(done.tokens) == llama_refs.greedy(prompt, N_TOK), msg
            drafted += sum(done.stats.verify_lengths)
            assert sum(done.stats.cycle_accepted) > 0      # the quantized draft still gets tokens accepted
    assert drafted > 0


def _block_logits(sp, drafts, msg):
    """Each draft's logits for one block after the prompt (same target features): outtype -> [rows, vocab]."""
    from pyllama_dspark.llama.handles import Draft

    t = sp.target
    prompt = np.asarray(sp.chat_prompt([{"role": "user", "content": msg}]).tokens, dtype=np.int32)
    t.clear()
    t.decode(prompt, 0)
    feats = t.features(0, len(prompt))
    anchor = int(np.argmax(t.logits(len(prompt) - 1)))
    out = {}
    for o, path in drafts.items():
        d = Draft(path, t)
        try:
            d.inject(feats, np.arange(len(prompt), dtype=np.int32))
            block = np.full(d.meta.block_size, d.meta.mask_token_id, dtype=np.int32)
            block[0] = anchor
            d.decode_block(block, len(prompt))
            out[o] = np.stack([d.logits(i) for i in range(len(block))])
        finally:
            d.close()
    return out


def test_block_logits_stay_within_tolerance_of_f32(drafts, target_path):
    from pyllama_dspark.decode.api import Speculator

    worst = {o: 0.0 for o in UNIT}
    means = {o: [] for o in UNIT}
    with Speculator(target_path, drafts["f32"], n_ctx=512, n_threads=1, schedule="off") as sp:
        for msg in PROMPTS:
            logits = _block_logits(sp, drafts, msg)
            finite = np.isfinite(logits["f32"])        # the reduced vocabulary: -inf outside d2t
            ref = np.where(finite, logits["f32"], 0.0)
            spread = float(np.min(ref.max(1, where=finite, initial=-np.inf) - ref.min(1, where=finite,
                                                                                  initial=np.inf)))
            top2 = np.sort(np.where(finite, ref, -np.inf), 1)[:, -2:]
            for o, u in UNIT.items():
                assert np.array_equal(np.isfinite(logits[o]), finite), o
                diff = np.abs(np.where(finite, logits[o], 0.0) - ref)
                tol = K_TYPE.get(o, K) * u * spread
                ratio = float(diff.max()) / (u * spread)
                print(f"{o:5s} {msg[:24]!r}: max |d| {diff.max():.4f} mean {diff[finite].mean():.5f} "
                      f"spread {spread:.2f} -> max|d|/(u R) {ratio:.2f} (bound {K_TYPE.get(o, K):g})")
                assert diff.max() <= tol, (o, float(diff.max()), tol)
                clear = (top2[:, 1] - top2[:, 0]) > 2 * tol      # rows without a near tie keep their draft
                assert np.array_equal(logits[o].argmax(1)[clear], logits["f32"].argmax(1)[clear]), o
                worst[o] = max(worst[o], ratio)
                means[o].append(float(diff[finite].mean()))
    # coarser formats are further from f32 (a conversion that ignored --outtype would tie here)
    m = {o: float(np.mean(v)) for o, v in means.items()}
    assert 0 < m["f16"] < m["bf16"] < m["q8_0"], m
