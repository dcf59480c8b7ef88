"""``pyllama-dspark bench`` and the DFlash-mode copy of a DSpark draft.

The end-to-end run is small (two prompts, one of them a two-turn mt-bench conversation, 8 tokens
per turn); its speed numbers are printed, never asserted.  What is asserted: the structure of the
report, interleaving, the multi-turn conversation, identical greedy output in every configuration.
"""

from __future__ import annotations

import json
import os

import gguf
import pytest
from click.testing import CliRunner

from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.measure.bench import RequestResult, rotated
from pyllama_dspark.measure.bench_report import compare, report_text, summarize, summary_table
from pyllama_dspark.cli.main import main
from pyllama_dspark.drafts.dflash_mode import DSPARK_KEYS, dflash_mode_draft
from pyllama_dspark.prompts import default_prompt_dir


def _res(config, cat, tps_ms, lat, drafted, accepted, cycles, pd, pa, n=10, tokens=(1, 2)):
    r = RequestResult(config, cat + "-src", cat, 0, 1, n_prompt=5, n_generated=n, ms_decode=tps_ms,
                      latency_s=lat, drafted=drafted, accepted=accepted, cycles=cycles,
                      pos_drafted=list(pd), pos_accepted=list(pa), tokens=list(tokens))
    return r


def test_rotated_order_visits_every_position():
    cfgs = ["none", "dflash", "dspark"]
    orders = [rotated(cfgs, i) for i in range(3)]
    assert all(sorted(o) == sorted(cfgs) for o in orders)
    assert [o[0] for o in orders] == cfgs


def test_summaries_and_comparison_rows():
    rs = [_res("none", "math", 1000.0, 2.0, 0, 0, 10, [], []),
          _res("dspark", "math", 500.0, 1.0, 20, 10, 5, [5, 4, 1], [4, 1, 0]),
          _res("none", "chat", 2000.0, 4.0, 0, 0, 10, [], []),
          _res("dspark", "chat", 1000.0, 2.0, 10, 0, 10, [10], [0])]
    s = summarize([r for r in rs if r.config == "dspark"])
    assert s["accept_rate"] == pytest.approx(10 / 30)
    assert s["tau"] == pytest.approx((10 + 15) / 15)
    assert s["accept_per_position"] == pytest.approx([4 / 15, 1 / 4, 0.0])
    table = summary_table(rs)
    assert list(table["dspark"]) == ["math", "chat", "overall"]
    rows = {r["category"]: r for r in compare(table, "none", "dspark")}
    assert rows["math"]["decode_speedup"] == pytest.approx(2.0)       # 20 tok/s vs 10 tok/s
    assert rows["math"]["latency_speedup"] == pytest.approx(2.0)
    assert rows["overall"]["base_avg_pred_t_s"] == pytest.approx((10 + 5) / 2)
    text = report_text(rs)
    assert "decode_speedup" in text and "latency_speedup" in text and "accept_rate" in text
    assert "WARNING" not in text
    rs[1].tokens = [9, 9]
    assert "greedy outputs differ" in report_text(rs)


def test_dflash_mode_copy(target_path, dspark_draft_path, tmp_path):
    out = dflash_mode_draft(dspark_draft_path, tmp_path)
    assert out != dspark_draft_path
    src, dst = gguf.GGUFReader(dspark_draft_path), gguf.GGUFReader(out)
    a = {t.name: (t.tensor_type, t.data.tobytes()) for t in src.tensors}
    b = {t.name: (t.tensor_type, t.data.tobytes()) for t in dst.tensors}
    assert sorted(set(a) - set(b)) == ["conf_proj.bias", "conf_proj.weight", "markov_w1.weight", "markov_w2.weight"]
    assert all(a[k] == b[k] for k in b)
    assert not any(k in dst.fields for k in DSPARK_KEYS)
    assert set(src.fields) - set(dst.fields) == set(DSPARK_KEYS)
    mtime = os.stat(out).st_mtime_ns
    assert dflash_mode_draft(dspark_draft_path, tmp_path) == out and os.stat(out).st_mtime_ns == mtime  # cached
    assert dflash_mode_draft(out, tmp_path) == out  # already DFlash
    with Speculator(target_path, out, n_ctx=512, n_threads=1) as sp:
        assert sp.proposer.name == "dflash" and sp.proposer.offset == 1   # drafts from rows 1..
        assert sp.proposer.max_draft() == 6


def test_bench_cli_small_run(dspark_draft_path, target_path, tmp_path):
    d = default_prompt_dir()
    assert d is not None
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    r = CliRunner().invoke(main, ["bench", "-m", target_path, "-md", dspark_draft_path,
                                  "--prompts", str(d / "gsm8k.jsonl"), "--prompts", str(d / "mt-bench.jsonl"),
                                  "--limit", "1", "-n", "8", "-t", "1", "-c", "2048", "--no-progress",
                                  "--json", str(out_json), "--plot", str(out_png)])
    print(r.output)
    assert r.exit_code == 0, r.output
    assert "dspark vs baseline" in r.output and "dflash vs baseline" in r.output
    assert "dspark-fixed vs baseline" in r.output and "dspark-fixed vs dflash" in r.output
    data = json.loads(out_json.read_text())
    assert data["greedy_mismatches"] == []
    res = data["results"]
    # auto: DSpark with the default schedule and with llama.cpp's fixed block; the scheduled
    # variants join because the random draft has a confidence head
    cfgs = ["dflash", "dspark", "dspark-fixed", "dspark-static", "dspark-survival", "none"]
    assert sorted({x["config"] for x in res}) == cfgs and len(res) == 12
    assert {x["turns"] for x in res if x["source"] == "mt-bench"} == {2}
    assert all(x["n_generated"] >= 2 for x in res)
    assert all(x["drafted"] > 0 for x in res if x["config"] != "none")
    assert all(x["drafted"] == 0 for x in res if x["config"] == "none")
    for cfg in cfgs:
        assert set(data["summary"][cfg]) == {"math", "chat", "overall"}
    assert {"dspark_vs_none", "dflash_vs_none", "dspark_vs_dflash", "dspark-static_vs_none"} <= set(data["comparisons"])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_cli_bad_input(tmp_path):
    r = CliRunner().invoke(main, ["bench", "--configs", "none,warp"])
    assert r.exit_code == 2 and "unknown configuration" in r.output
    r = CliRunner().invoke(main, ["bench", "--configs", "dspark-static", "--temp", "0.5", "--limit", "1"])
    assert r.exit_code == 2 and "greedy only" in r.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nope": 1}\n')
    r = CliRunner().invoke(main, ["bench", "--configs", "none", "--prompts", str(bad)])
    assert r.exit_code == 1 and "turns" in r.output
