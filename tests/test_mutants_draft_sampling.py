"""Mutation-score tests for speculative/draft_sampling.py: the confidence head, the bias delta, the
left-to-right block sampler (fake draft / Markov head / sampler with scripted draws) and the
GGUF readers (files written with the gguf package), against hand-computed values."""

import math

import numpy as np
import pytest

from pyllama_dspark.errors import DraftMismatchError
from pyllama_dspark.speculative.draft_sampling import (CONDITIONING, BlockSampler, ConfHead, bias_delta, read_conf_head,
                                                read_d2t)


def test_conf_head_by_hand():
    h = ConfHead(np.array([1.0, 2.0]), np.array([0.5]), -1.0)
    # z = 1 + 2 + 0.5 * 2 - 1 = 3
    assert h(np.array([1.0, 1.0]), np.array([2.0])) == pytest.approx(1 / (1 + math.exp(-3)))
    assert ConfHead(np.zeros(2), np.zeros(1), 0.0)(np.ones(2), np.ones(1)) == 0.5
    assert isinstance(h(np.ones(2), np.ones(1)), float)


def test_bias_delta_by_hand():
    d = bias_delta(np.array([1.0, 2.0, 3.0]), np.array([0.5, 2.0, 5.0]), None, 3)
    assert d.dtype == np.float32 and d.tolist() == [-0.5, 0.0, 2.0]
    with pytest.raises(ValueError, match="^bias rows have 3 entries for a 4-token vocabulary and no d2t$"):
        bias_delta(np.zeros(3), np.zeros(3), None, 4)
    full = bias_delta(np.array([1.0, 1.0]), np.array([3.0, 0.0]), np.array([4, 1]), 6)
    assert full.dtype == np.float32 and full.tolist() == [0.0, -1.0, 0.0, 0.0, 2.0, 0.0]
    with pytest.raises(ValueError, match="^d2t has 3 entries, the bias rows 2$"):
        bias_delta(np.zeros(2), np.zeros(2), np.array([0, 1, 2]), 6)


class Meta:
    block_size = 3


class FakeDraft:
    n_vocab = 4
    meta = Meta()

    def __init__(self, rows, argmax, conf):
        self.rows, self.am, self.cf = rows, argmax, conf
        self.calls = []

    def argmax(self, row0, n, out, margin):
        self.calls.append(("argmax", row0, n))
        out[:n] = self.am[row0:row0 + n]

    def confidence(self, row0, n, out):
        self.calls.append(("confidence", row0, n))
        out[:n] = self.cf[row0:row0 + n]

    def logits_view(self, i):
        return self.rows[i]

    def hidden(self, i):
        return np.array([float(i), 1.0])


class FakeMarkov:
    def __init__(self):
        self.asked = []

    def bias_w1(self, toks):
        self.asked.append(list(toks))
        b = np.array([[float(t) * (10 + j) for j in range(4)] for t in toks], dtype=np.float32)
        w1 = np.array([[float(t)] for t in toks])
        return b, w1


class ScriptedSampler:
    def __init__(self, draws):
        self.draws = list(draws)
        self.seen = []

    def draft_probs(self, logits, history):
        self.seen.append((np.array(logits, dtype=np.float64).tolist(), list(history)))
        return ("q", len(self.seen))

    def sample(self, q):
        return self.draws.pop(0)


ROWS = [np.array([0.0, 1.0, 2.0, 3.0], dtype=np.float32) + 100 * i for i in range(5)]


def _sampler(markov, conditioning="sampled", conf=True, d2t=None):
    draft = FakeDraft(ROWS, np.array([9, 1, 2, 0, 3], dtype=np.int32), np.array([0.9, 0.8, 0.7, 0.6, 0.5]))
    head = ConfHead(np.array([1.0, 0.0]), np.array([1.0]), 0.0) if conf else None
    return draft, BlockSampler(draft, markov, head, d2t, conditioning)


def test_block_sampler_conditions_on_the_drawn_token():
    mk = FakeMarkov()
    draft, bs = _sampler(mk)
    assert bs.n_vocab == 4 and bs._argmax.size == 4 and bs.n_bias_calls == 0
    smp = ScriptedSampler([3, 2, 1])
    toks, q, conf = bs.sample(1, 3, smp)
    assert toks.dtype == np.int32 and toks.tolist() == [3, 2, 1] and q == [("q", 1), ("q", 2), ("q", 3)]
    assert draft.calls == [("argmax", 1, 3), ("confidence", 1, 3)]
    # B(t)_j = t * (10 + j). k = 0 (row 1): as decoded; k = 1 (row 2): graph token a_0 = 1, drawn 3:
    # row + B(3) - B(1) = row + 2 * (10 + j);
    # k = 2 (row 3): a_1 = 2 == drawn 2: as decoded
    assert smp.seen[0] == (ROWS[1].tolist(), [])
    assert smp.seen[1] == ((ROWS[2] + [20, 22, 24, 26]).tolist(), [3])
    assert smp.seen[2] == (ROWS[3].tolist(), [3, 2])
    assert mk.asked == [[1, 3]] and bs.n_bias_calls == 1
    # confidence recomputed at k = 1: sigmoid(h . [1, 0] + W1[3] = 2 + 3)
    assert conf.tolist() == pytest.approx([0.8, 1 / (1 + math.exp(-5)), 0.6])
    assert conf.dtype == np.float32


def test_block_sampler_variants():
    mk = FakeMarkov()
    _, bs = _sampler(mk, conditioning="argmax")
    smp = ScriptedSampler([3, 2])
    bs.sample(0, 2, smp)
    assert mk.asked == [] and smp.seen[1] == (ROWS[1].tolist(), [3])
    _, bs = _sampler(None)
    smp = ScriptedSampler([3, 0])
    toks, _, conf = bs.sample(0, 2, smp)
    assert toks.tolist() == [3, 0] and smp.seen[1] == (ROWS[1].tolist(), [3]) and conf.tolist() == pytest.approx([0.9, 0.8])
    draft, bs = _sampler(FakeMarkov())
    _, _, conf = bs.sample(0, 2, ScriptedSampler([1, 1]), with_conf=False)
    assert conf is None and ("confidence", 0, 2) not in draft.calls
    _, bs = _sampler(FakeMarkov(), conf=False)
    smp = ScriptedSampler([2, 0])
    _, _, conf = bs.sample(0, 2, smp)
    assert conf is None and smp.seen[1] == ((ROWS[1] - 7 * np.arange(10, 14)).tolist(), [2])
    # reduced vocabulary: the delta is scattered through d2t
    mk = FakeMarkov()
    _, bs = _sampler(mk, d2t=np.array([3, 2, 1, 0]))
    smp = ScriptedSampler([0, 0])
    bs.sample(2, 2, smp)        # a_0 = 2, drawn 0: draft row j gets -2 * (10 + j), at target id d2t[j] = 3 - j
    assert smp.seen[1] == ((ROWS[3] + [-26, -24, -22, -20]).tolist(), [0])
    # two draws off the graph's argmax: two bias calls
    mk = FakeMarkov()
    _, bs = _sampler(mk)
    bs.sample(0, 3, ScriptedSampler([3, 2, 1]))
    assert mk.asked == [[9, 3], [1, 2]] and bs.n_bias_calls == 2
    assert BlockSampler(FakeDraft(ROWS, None, None)).conditioning == "sampled"
    assert CONDITIONING == ("sampled", "argmax")
    with pytest.raises(ValueError, match=r"^conditioning must be one of \('sampled', 'argmax'\), got 'x'$"):
        BlockSampler(FakeDraft(ROWS, None, None), conditioning="x")


def _write(path, tensors):
    import gguf

    w = gguf.GGUFWriter(str(path), "dflash")
    for name, arr, raw in tensors:
        if raw is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_shape=arr.shape, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_gguf_readers(tmp_path):
    w = np.arange(5, dtype=np.float32) / 4
    p = _write(tmp_path / "a.gguf", [("conf_proj.weight", w, None), ("conf_proj.bias", np.array([0.25], np.float32), None),
                                     ("d2t", np.array([5, 3, 1], dtype=np.int32), None)])
    h = read_conf_head(p, 3, 2)
    assert h.w_h.tolist() == [0.0, 0.25, 0.5] and h.w_r.tolist() == [0.75, 1.0] and h.b == 0.25
    assert h.w_h.dtype == np.float64 and h.w_r.dtype == np.float64
    d = read_d2t(p)
    assert d.tolist() == [5, 3, 1] and d.dtype == np.int64
    with pytest.raises(DraftMismatchError, match=r"^conf_proj.weight has 5 values, expected n_embd \+ rank = 6$"):
        read_conf_head(p, 4, 2)
    q = _write(tmp_path / "b.gguf", [("conf_proj.weight", w.astype(np.float16), None), ("x", np.zeros(2, np.float32), None)])
    h = read_conf_head(q, 2, 3)
    assert h.w_h.tolist() == [0.0, 0.25] and h.w_r.tolist() == [0.5, 0.75, 1.0] and h.b == 0.0
    assert read_d2t(q) is None
    assert read_conf_head(_write(tmp_path / "c.gguf", [("d2t", np.array([1], np.int32), None)]), 1, 1) is None


def test_gguf_reader_dequantizes(tmp_path):
    import gguf
    from gguf.quants import quantize

    w = (np.arange(64, dtype=np.float32) - 32) / 8          # exact in Q8_0 (scale 0.5 / 127 steps ... checked below)
    qw = quantize(w.reshape(1, 64), gguf.GGMLQuantizationType.Q8_0)
    p = _write(tmp_path / "q.gguf", [("conf_proj.weight", qw, gguf.GGMLQuantizationType.Q8_0)])
    h = read_conf_head(p, 60, 4)
    got = np.concatenate([h.w_h, h.w_r])
    assert got.shape == (64,) and np.max(np.abs(got - w)) < 0.02
