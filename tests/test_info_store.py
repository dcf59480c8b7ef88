"""What a model file's metadata says is parsed once per file version and kept on disk
(gguf/info_store.py): a later process reads the same infos without parsing, a changed file is
parsed again, a file that failed the checks is never remembered as passing, a broken entry is
ignored.  Each check runs in a fresh process (the in-process cache would hide the disk), with its own
cache folder; a process that must not parse has gguf-py's reader replaced by one that raises."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pyllama_dspark.gguf.testing import make_test_draft

SCRIPT = r"""
import json, sys
if sys.argv[1] == "no-parse":
    import gguf
    def refuse(*a, **k):
        raise AssertionError("parsed a GGUF")
    gguf.GGUFReader.__init__ = refuse
import pyllama_dspark.paths  # noqa: F401  (sets the folder of the store)
from pyllama_dspark.gguf.info import read_draft_info
from pyllama_dspark.gguf.target_info import read_target_info
from pyllama_dspark.llama.backend import check_gguf_file
out = {}
for kind, path in (("target", sys.argv[2]), ("draft", sys.argv[3])):
    try:
        check_gguf_file(path)
        info = (read_target_info if kind == "target" else read_draft_info)(path)
        out[kind] = {k: v for k, v in vars(info).items()}
    except Exception as e:   # the error a user would see
        out[kind] = {"error": type(e).__name__ + ": " + str(e)}
print(json.dumps(out, default=list))
"""


def _infos(mode, target, draft, cache):
    env = dict(os.environ, PYLLAMA_DSPARK_CACHE=str(cache))
    p = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(target), str(draft)], capture_output=True,
                       text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def test_infos_are_parsed_once_per_file_version(target_path, tmp_path):
    cache = tmp_path / "cache"
    draft = make_test_draft(target_path, tmp_path / "d.gguf", kind="dspark", n_layers=1, seed=3)
    cold = _infos("no-parse", target_path, draft, cache)   # nothing stored yet: the stand-in refuses
    assert "parsed a GGUF" in cold["target"]["error"] and "parsed a GGUF" in cold["draft"]["error"], cold
    first = _infos("parse", target_path, draft, cache)
    assert "error" not in first["target"] and "error" not in first["draft"], first
    assert first["draft"]["block_size"] == 7 and first["target"]["n_vocab"] == 49152
    # a later process: the same infos, and gguf-py's reader is never called
    again = _infos("no-parse", target_path, draft, cache)
    assert again == first
    # the file changes (another block size): parsed again, the new value
    make_test_draft(target_path, draft, kind="dspark", n_layers=1, block_size=5, seed=3)
    changed = _infos("parse", target_path, draft, cache)
    assert changed["draft"]["block_size"] == 5 and changed["target"] == first["target"]
    # broken entries are ignored and rewritten
    for f in (cache / "gguf-info").glob("*.json"):
        f.write_text("{not json")
    assert _infos("parse", target_path, draft, cache) == changed
    valid = 0
    for f in (cache / "gguf-info").glob("*.json"):   # the current file versions' four entries rewritten
        try:
            valid += bool(json.loads(f.read_text()))
        except ValueError:
            pass
    assert valid == 4


def test_a_file_that_fails_the_checks_is_not_remembered_as_passing(target_path, tmp_path):
    cache = tmp_path / "cache"
    draft = tmp_path / "d.gguf"
    make_test_draft(target_path, draft, kind="dspark", n_layers=1, seed=4)
    good = draft.read_bytes()
    draft.write_bytes(good[: len(good) // 2])          # truncated
    for _ in range(2):
        bad = _infos("parse", target_path, draft, cache)["draft"]
        assert bad["error"].startswith("ModelFileError") and "truncated" in bad["error"], bad
    draft.write_bytes(good)                            # mended: passes, then is remembered
    assert "error" not in _infos("parse", target_path, draft, cache)["draft"]
    assert "error" not in _infos("no-parse", target_path, draft, cache)["draft"]


HEADS = r"""
import json, sys
if sys.argv[1] == "no-parse":
    import gguf
    def refuse(*a, **k):
        raise AssertionError("parsed a GGUF")
    gguf.GGUFReader.__init__ = refuse
import pyllama_dspark.paths  # noqa: F401
from pyllama_dspark.speculative.draft_sampling import read_conf_head, read_d2t
c = read_conf_head(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
print(json.dumps({"w": list(c.w_h) + list(c.w_r), "b": c.b, "d2t": read_d2t(sys.argv[2]).tolist()}))
"""


def test_the_draft_heads_t_above_0_reads_are_kept_too(tmp_path):
    """T > 0 drafting reads the confidence head and d2t from the draft file: a later process gets
    them without parsing, equal to gguf-py's own tensor data (the shipped drafter: F32 conf_proj,
    a reduced vocabulary)."""
    import gguf
    import numpy as np
    import pyllama_dspark

    draft = os.path.join(os.path.dirname(pyllama_dspark.__file__), "data", "SmolLM2-135M-Instruct-DSpark.gguf")
    r = gguf.GGUFReader(draft)
    t = {x.name: np.asarray(x.data).reshape(-1) for x in r.tensors if x.name in ("conf_proj.weight", "conf_proj.bias",
                                                                                   "d2t")}
    f = r.fields["dflash.embedding_length"]
    n_embd = int(f.parts[f.data[0]][0])
    rank = t["conf_proj.weight"].size - n_embd
    env = dict(os.environ, PYLLAMA_DSPARK_CACHE=str(tmp_path))
    outs = []
    for mode in ("parse", "no-parse"):
        p = subprocess.run([sys.executable, "-c", HEADS, mode, draft, str(n_embd), str(rank)], capture_output=True,
                           text=True, env=env, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        outs.append(json.loads(p.stdout))
    assert outs[0] == outs[1]
    assert outs[1]["w"] == t["conf_proj.weight"].astype(np.float64).tolist()
    assert outs[1]["b"] == float(t["conf_proj.bias"][0]) and outs[1]["d2t"] == t["d2t"].astype(np.int64).tolist()
