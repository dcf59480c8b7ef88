"""Mutation-score tests for speculative/calibration.py: the file format, the draft binding (hashlib as the
reference) and the record arrays, by hand."""

import hashlib
import json

import numpy as np
import pytest

from pyllama_dspark.errors import DSparkError
from pyllama_dspark.speculative.calibration import (CALIBRATION_VERSION, Calibration, file_sha256, fit, load_calibration,
                                             records_to_arrays)


def test_file_sha256_against_hashlib(tmp_path):
    data = bytes(range(256)) * 5000          # > 1 MiB: several chunks
    p = tmp_path / "d.gguf"
    p.write_bytes(data)
    assert file_sha256(p) == hashlib.sha256(data).hexdigest()
    e = tmp_path / "e"
    e.write_bytes(b"")
    assert file_sha256(str(e)) == hashlib.sha256(b"").hexdigest()


def test_save_load_and_checks(tmp_path):
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"draft")
    cal = Calibration(hashlib.sha256(b"draft").hexdigest(), [1.5, 0.5], [{"position": 1}], 3, 4)
    assert CALIBRATION_VERSION == 1 and cal.version == 1
    path = tmp_path / "c.json"
    cal.save(path)
    data = json.loads(path.read_text())
    assert data == {"draft_sha256": cal.draft_sha256, "temperatures": [1.5, 0.5], "report": [{"position": 1}],
                    "n_fit": 3, "n_eval": 4, "version": 1}
    assert load_calibration(path) == cal
    assert load_calibration(str(path), str(draft)) == cal
    assert Calibration("x", [1.0]).report == [] and Calibration("x", [1.0]).n_fit == 0
    assert Calibration("x", [1.0]).n_eval == 0
    other = tmp_path / "other.gguf"
    other.write_bytes(b"other")
    with pytest.raises(DSparkError, match=r"c\.json was fitted for another draft \(content hash differs from .*other"):
        load_calibration(path, other)
    data["version"] = 2
    path.write_text(json.dumps(data))
    with pytest.raises(DSparkError, match=r"c\.json: calibration version 2 != 1"):
        load_calibration(path)
    for text in ("{", '{"draft_sha256": "x"}', '{"nope": 1, "draft_sha256": "x", "temperatures": []}'):
        path.write_text(text)
        with pytest.raises(DSparkError, match=r"^cannot read calibration file .*c\.json: "):
            load_calibration(path)
    with pytest.raises(DSparkError, match="cannot read calibration file"):
        load_calibration(tmp_path / "missing.json")


def test_records_to_arrays_by_hand():
    recs = [(np.array([0.9, 0.8, 0.7]), 3, 2), (np.array([0.5]), 1, 0), ([0.6, 0.4], 5, 4)]
    conf, ver, acc = records_to_arrays(recs, 2)
    assert conf.tolist() == [[0.9, 0.8], [0.5, 1.0], [0.6, 0.4]]
    assert ver.tolist() == [2, 1, 2] and acc.tolist() == [2, 0, 4]
    assert ver.dtype.kind == "i" and acc.dtype.kind == "i"
    c, v, a = records_to_arrays([], 3)
    assert c.shape == (0, 3) and v.shape == (0,) and a.shape == (0,)


def test_fit(tmp_path):
    draft = tmp_path / "d.gguf"
    draft.write_bytes(b"abc")
    recs = [(np.array([0.8, 0.8]), 2, 2)] * 4
    ev = [(np.array([0.8, 0.8]), 2, 2), (np.array([0.8, 0.8]), 2, 0)]
    cal = fit(recs, ev, 2, str(draft))
    assert cal.draft_sha256 == hashlib.sha256(b"abc").hexdigest()
    # every fitted block accepted both drafts: the smallest temperature of the grid at both positions
    assert cal.temperatures == pytest.approx([0.25, 0.25]) and all(type(t) is float for t in cal.temperatures)
    assert (cal.n_fit, cal.n_eval) == (4, 2)
    assert [r["position"] for r in cal.report] == [1, 2] and cal.report[0]["n"] == 2
    assert cal.report[0]["survival"] == 0.5 and cal.report[0]["ece_raw"] == pytest.approx(0.3)
    # blocks that verified one position only: position 2 is fitted on nothing (temperature 1) and
    # reported with n = 0; without the verified counts it would be fitted on "rejected" labels
    short = [(np.array([0.8, 0.8]), 1, 1)] * 4
    cal = fit(short, short, 2, str(draft))
    assert cal.temperatures[1] == 1.0 and cal.report[1]["n"] == 0 and cal.report[0]["n"] == 4
    for f, e in (([], ev), (recs, [])):
        with pytest.raises(DSparkError, match=r"^not enough drafted blocks to calibrate \(need some for fitting and"):
            fit(f, e, 2, str(draft))
