"""Mutation-score tests for decode/cycle.py: Stats arithmetic, the prompt check, text with stop
strings and the verify rows, against hand-computed values (fake target, no model)."""

import numpy as np
import pytest

from pyllama_dspark.decode.cycle import (Chunk, Done, OneHotRows, PieceCache, Started, Stats, TargetRows,
                                         TextStream, check_prompt)
from pyllama_dspark.errors import ContextOverflowError


def test_stats_record_by_hand():
    s = Stats()
    assert s.tau == 0.0 and s.accept_per_position == [] and s.tokens_per_second == 0.0
    s.record(3, 1)          # positions 0, 1 tried, 0 accepted
    s.record(2, 2)          # positions 0, 1 tried and accepted
    s.record(0, 0)          # a cycle without drafts
    s.record(4, 0)          # position 0 tried
    assert (s.cycles, s.drafted, s.accepted) == (4, 9, 3)
    assert s.verify_lengths == [3, 2, 0, 4] and s.cycle_accepted == [1, 2, 0, 0]
    assert s.pos_drafted == [3, 2, 0, 0] and s.pos_accepted == [2, 1, 0, 0]
    assert s.tau == (3 + 4) / 4
    assert s.accept_per_position == [2 / 3, 0.5, 0.0, 0.0]


def test_stats_times_dict_and_summary():
    s = Stats(n_prompt=5, n_generated=10, ms_total=500.0, ms_draft=100.0, ms_verify=200.0, ms_inject=50.0,
              ms_sample=25.0, ms_prefill=7.0, ms_llama=350.0)
    s.record(2, 1)
    s.record(2, 0)
    assert s.ms_overhead == 125.0 and s.tokens_per_second == 20.0
    assert Stats(ms_total=1.0, ms_verify=5.0).ms_overhead == 0.0
    d = s.as_dict()
    assert d == {"n_prompt": 5, "n_generated": 10, "drafted": 4, "accepted": 1, "tau": 1.5, "cycles": 2,
                 "near_ties": 0, "tokens_per_second": 20.0, "accept_per_position": [0.5, 0.0],
                 "ms": {"prefill": 7.0, "draft": 100.0, "verify": 200.0, "inject": 50.0, "sample": 25.0,
                        "overhead": 125.0, "total": 500.0, "llama": 350.0, "host": 150.0,
                        "host_per_cycle": 75.0}}
    s.ms_hidden = 12.5
    assert s.as_dict()["ms"]["hidden"] == 12.5
    s.ms_hidden = 0.0
    s.seed, s.schedule = 42, "auto: x"
    assert s.as_dict()["seed"] == 42 and s.as_dict()["schedule"] == "auto: x"
    s.seed = 0
    assert s.as_dict()["seed"] == 0
    assert s.summary() == ("prompt 5 tok, generated 10 tok in 500.0 ms (20.00 tok/s); cycles 2, drafted 4, "
                           "accepted 1, tau 1.500; per-position acceptance [0.50 0.00]; ms/cycle draft 50.00 "
                           "verify 100.00 inject 25.00 sample 12.50 overhead 62.500, host 75.000")
    s2 = Stats(n_generated=3, ms_total=30.0)
    assert s2.summary() == ("prompt 0 tok, generated 3 tok in 30.0 ms (100.00 tok/s); cycles 0, drafted 0, "
                            "accepted 0, tau 0.000; per-position acceptance []; ms/cycle draft 0.00 verify 0.00 "
                            "inject 0.00 overhead 30.000, host 30.000")
    f = Stats(ms_prefill=1.23456, ms_draft=2.34567, ms_verify=3.45678, ms_inject=0.11111, ms_sample=0.22222,
              ms_total=9.87654)
    f.record(3, 1)
    assert f.as_dict()["ms"] == {"prefill": 1.235, "draft": 2.346, "verify": 3.457, "inject": 0.111, "sample": 0.222,
                                 "overhead": 3.741, "total": 9.877, "llama": 0.0, "host": 9.877,
                                 "host_per_cycle": 9.8765}
    assert f.as_dict()["accept_per_position"] == [1.0, 0.0, 0.0]
    g = Stats()
    g.record(3, 1)
    g.record(3, 0)
    g.record(3, 2)
    assert g.as_dict()["accept_per_position"] == [0.6667, 0.5, 0.0]
    r = Stats(ms_total=3.0, n_generated=1)
    r.accepted, r.cycles = 1, 3
    assert r.as_dict()["tau"] == 1.3333 and r.as_dict()["tokens_per_second"] == 333.333


def test_events():
    assert Chunk([1], "a").probs is None and Started(3).slot == 3
    d = Done([1], "a", "stop", Stats())
    assert d.stop_word is None and d.probs is None


def test_check_prompt():
    t = check_prompt([1, np.int64(2), 9], 10, 4)
    assert t.dtype == np.int32 and t.tolist() == [1, 2, 9]
    with pytest.raises(TypeError, match="prompt token ids must be integers"):
        check_prompt([1, 2.0], 10, 8)
    with pytest.raises(TypeError, match="prompt token ids must be integers"):
        check_prompt([True], 10, 8)
    with pytest.raises(TypeError):
        check_prompt([np.bool_(True)], 10, 8)
    with pytest.raises(ValueError, match="the prompt is empty"):
        check_prompt([], 10, 8)
    with pytest.raises(ValueError, match=r"prompt token ids must be in 0\.\.9"):
        check_prompt([10], 10, 8)
    with pytest.raises(ValueError, match=r"prompt token ids must be in 0\.\.9"):
        check_prompt([-1, 3], 10, 8)
    with pytest.raises(ContextOverflowError, match="prompt of 4 tokens does not fit the context of 4 tokens"):
        check_prompt([1, 2, 3, 4], 10, 4)


class FakeTarget:
    def __init__(self, pieces):
        self.pieces = pieces
        self.asked = []

    def token_to_piece(self, t):
        self.asked.append(t)
        return self.pieces[t]


def test_piece_cache_asks_once():
    tg = FakeTarget({1: b"a", 2: b"b"})
    pc = PieceCache(tg)
    assert pc[1] == b"a" and pc[1] == b"a" and pc[2] == b"b"
    assert tg.asked == [1, 2] and pc.target is tg


PIECES = {0: b"Hel", 1: b"lo", 2: b" wor", 3: b"ld", 4: b"\xe2\x82", 5: b"\xac", 6: b"END", 7: b"!"}


def _stream(stop):
    return TextStream(PieceCache(FakeTarget(PIECES)), stop)


def test_text_stream_without_stop():
    ts = _stream(["", None or ""])
    assert ts.stop == [] and ts.hold == 0
    for t in (0, 1, 4):
        ts.push(t)
    assert ts.flush() == "Hello"         # half a UTF-8 character is held by the decoder
    ts.push(5)
    assert ts.flush() == "€" and not ts.stopped
    ts.push(4)
    assert ts.flush(final=True) == "\ufffd"


def test_text_stream_holds_back_only_the_start_of_a_stop_string():
    ts = _stream(["END", "o w"])
    assert ts.hold == 2
    ts.push(0)
    assert ts.flush() == "Hel"           # no end of "Hel" begins "END" or "o w": all of it goes
    ts.push(1)
    assert ts.flush() == "l"             # "Hello": its "o" may begin "o w"
    assert ts.sent == 4
    ts.push(2)                            # "Hello wor": "o w" found at 4
    assert ts.stopped and ts.stop_word == "o w" and ts.text == "Hell"
    assert ts.flush() == "" and ts.flush(final=True) == ""
    ts = _stream(["END"])
    ts.push(6)
    assert ts.stopped and ts.text == ""
    ts = _stream(["ENDX"])
    ts.push(6)
    assert ts.flush() == "" and ts.flush(final=True) == "END"   # all three may begin "ENDX"


def test_text_stream_earliest_stop_and_search_window():
    ts = _stream(["ld", "wor"])
    for t in (0, 1, 2, 3):
        ts.push(t)
        if ts.stopped:
            break
    assert ts.stop_word == "wor" and ts.text == "Hello "
    ts = _stream(["lo", "Hel"])
    ts.push(0)
    assert ts.stop_word == "Hel" and ts.text == ""
    # a stop string spanning pieces already sent in part: the search starts hold + 1 before sent
    ts = _stream(["llo w"])
    assert ts.hold == 4
    ts.push(0)
    assert ts.flush() == "He" and ts.sent == 2   # "l" may begin "llo w"
    ts.push(1)
    assert ts.flush() == "" and ts.sent == 2     # "llo" may too
    ts.push(2)
    assert ts.stopped and ts.text == "He" and ts.flush(final=True) == ""
    ts = _stream(["!"])
    assert ts.hold == 0
    ts.push(6)
    assert ts.flush() == "END"
    ts.push(7)
    assert ts.stopped and ts.text == "END" and ts.flush() == ""


def test_text_stream_final_flush_decodes_pending_bytes_only_when_not_stopped():
    ts = _stream(["zz"])
    ts.push(4)
    assert ts.flush(final=True) == "\ufffd"
    ts = _stream(["Hel"])
    ts.push(0)
    assert ts.stopped and ts.flush(final=True) == ""


def test_one_hot_rows_and_target_rows():
    rows = OneHotRows(np.array([3, 1]), 5)
    assert len(rows) == 2
    assert rows[0].ids.tolist() == [3] and rows[1].ids.tolist() == [1] and rows[1].n_vocab == 5
    assert rows[1][1] == 1.0

    class T:
        def logits_view(self, i):
            return ("row", i)

    class S:
        def probs(self, logits, history):
            return (logits, list(history))

    tr = TargetRows(T(), S(), np.array([7, 8, 9]), row0=4)
    assert tr[0] == (("row", 4), []) and tr[2] == (("row", 6), [7, 8])
    assert TargetRows(T(), S(), np.array([7]))[1] == (("row", 1), [7])
