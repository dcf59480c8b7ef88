"""The shim: one libllama in the process, feature capture, Markov bias on the backend vs numpy."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from pyllama_dspark.llama import _native as nat
from pyllama_dspark.errors import NativeError
from pyllama_dspark.llama.draft_meta import read_draft_meta
from pyllama_dspark.llama.handles import ContextSettings, Draft, Target
from pyllama_dspark.llama.markov_head import MarkovHead


def test_one_libllama_in_the_process():
    # the shim links libllama by SONAME only; it must bind to llama-cpp-python's copy
    assert nat.same_libllama()


def _tensor(reader, name):
    t = next(t for t in reader.tensors if t.name == name)
    return np.asarray(t.data, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])


def test_markov_bias_matches_numpy(dspark_draft_path):
    r = GGUFReader(dspark_draft_path)
    w1 = _tensor(r, "markov_w1.weight")  # [n_vocab, rank]
    w2 = _tensor(r, "markov_w2.weight")  # [n_vocab_draft, rank]
    prev = np.array([0, 1, 16, 4093, 49151, 1], dtype=np.int32)
    with MarkovHead(dspark_draft_path, n_threads=1) as m:
        assert (m.rank, m.n_vocab, m.n_vocab_draft) == (w1.shape[1], w1.shape[0], w2.shape[0])
        got = m.bias(prev)
        rows = m.w1_rows(prev)
    want = w1[prev].astype(np.float64) @ w2.T.astype(np.float64)
    np.testing.assert_allclose(rows, w1[prev], rtol=0, atol=0)
    # F32 weights, F32 accumulation over rank 32: relative error ~1e-6 of the row scale
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.array_equal(got[1], got[5])  # same prev -> same row


def test_markov_head_rejects_bad_input(dspark_draft_path, dflash_draft_path):
    with MarkovHead(dspark_draft_path) as m:
        with pytest.raises(ValueError):
            m.bias([49152])
        with pytest.raises(ValueError):
            m.bias([-1])
        with pytest.raises(ValueError):
            m.bias([])
    with pytest.raises(NativeError, match="no Markov head"):
        MarkovHead(dflash_draft_path)
    m.close()
    from pyllama_dspark.errors import ClosedError
    with pytest.raises(ClosedError):
        m.bias([1])


def test_capture_rows_are_the_target_layer_inputs(target_path, dspark_draft_path):
    meta = read_draft_meta(dspark_draft_path)
    settings = ContextSettings(n_threads=2)
    with Target(target_path, settings, capture_layers=meta.target_layers) as t:
        assert t.feature_width == len(meta.target_layers) * t.n_embd
        with pytest.raises(NativeError, match="no captured rows"):
            t.features(0, 1)  # llama.cpp would abort here; the shim refuses
        toks = np.array(t.tokenize("The quick brown fox jumps over the lazy dog."), dtype=np.int32)
        t.decode(toks, 0)
        f_all = t.features(0, len(toks))
        assert f_all.shape == (len(toks), t.feature_width) and np.isfinite(f_all).all()
        with pytest.raises(NativeError, match="outside"):
            t.features(0, len(toks) + 1)
        # causality: the first 4 rows of a longer decode equal a decode of the first 4 tokens
        t.seq_rm(0, 0, -1)
        t.decode(toks[:4], 0)
        np.testing.assert_allclose(t.features(0, 4), f_all[:4], rtol=1e-4, atol=1e-3)
        # layer-input 0 of the first listed layer differs from the next: rows are layer-major per token
        d = t.n_embd
        assert not np.allclose(f_all[:, :d], f_all[:, d:2 * d])


def test_draft_rejects_overlong_block_and_bad_tokens(target_path, dspark_draft_path):
    meta = read_draft_meta(dspark_draft_path)
    with Target(target_path, ContextSettings(n_threads=2), capture_layers=meta.target_layers) as t:
        d = Draft(dspark_draft_path, t)
        toks = np.array(t.tokenize("Hello there"), dtype=np.int32)
        t.decode(toks, 0)
        d.inject_captured(0, len(toks), 0)
        too_long = np.full(meta.block_size + 1, meta.mask_token_id, dtype=np.int32)
        with pytest.raises(NativeError, match="block_size"):
            d.decode_block(too_long, len(toks))  # llama.cpp would silently drop the Markov head
        with pytest.raises(NativeError, match="out of vocab"):
            d.decode_block(np.array([49152] + [16] * 6, dtype=np.int32), len(toks))
        block = np.array([toks[-1]] + [meta.mask_token_id] * 6, dtype=np.int32)
        d.decode_block(block, len(toks))
        conf = np.zeros(7, dtype=np.float32)
        d.confidence(0, 7, conf)
        assert ((conf > 0) & (conf < 1)).all()
        with pytest.raises(NativeError, match="not in the last draft decode"):
            d.confidence(5, 3, conf)
    # closing the target closed the draft too
    from pyllama_dspark.errors import ClosedError
    with pytest.raises(ClosedError):
        d.decode_block(block, 0)
