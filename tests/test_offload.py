"""``-ngl`` as llama.cpp reads it (a count, ``auto`` or ``all``; ``auto`` the default everywhere),
its resolution before a load (none on a machine without a GPU, so nothing changes on a CPU), and
the cost profile keyed by the resolved placement."""

from __future__ import annotations

import os

import click
import pytest
from llama_cpp import llama_cpp as ll

from pyllama_dspark.llama import offload
from pyllama_dspark.llama.offload import ALL_LAYERS, layers_that_fit, parse_n_gpu_layers, resolve_n_gpu_layers
from pyllama_dspark.llama.settings import ContextSettings


@pytest.mark.parametrize("value, expected", [
    # llama.cpp common/arg.cpp: "auto" -> -1, "all" -> -2, else std::stoi; common.h: -1 is auto, <= -2 all
    ("auto", "auto"), ("all", "all"), ("AUTO", "auto"), (" all ", "all"), ("0", 0), ("12", 12), (99, 99),
    (-1, "auto"), ("-1", "auto"), (-2, "all"), (-7, "all"), (0, 0),
])
def test_ngl_values_as_llama_cpp_reads_them(value, expected):
    assert parse_n_gpu_layers(value) == expected


@pytest.mark.parametrize("bad", ["some", "1.5", "", None, True, [3]])
def test_bad_ngl_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="n_gpu_layers"):
        parse_n_gpu_layers(bad)


def test_layers_that_fit_law():
    gib = 1 << 30
    # fits with the reserve: every layer
    assert layers_that_fit(4 * gib, gib, 32, 6 * gib + 1, reserve=gib) == ALL_LAYERS
    assert layers_that_fit(4 * gib, gib, 32, 6 * gib, reserve=gib) == ALL_LAYERS
    # one byte short: the share that fits, (free - reserve) / ((weights + kv) / (n_layer + 1)) whole layers
    assert layers_that_fit(4 * gib, gib, 32, 6 * gib - 1, reserve=gib) == 32
    assert layers_that_fit(33 * gib, 0, 32, 17 * gib, reserve=gib) == 16
    # nothing fits
    assert layers_that_fit(4 * gib, gib, 32, gib // 2, reserve=gib) == 0


def test_resolution_without_devices_is_zero(target_path):
    # a CPU: auto keeps everything local, without reading the file
    assert resolve_n_gpu_layers("auto", "/nonexistent.gguf", 4096, []) == 0
    assert resolve_n_gpu_layers("all", "/nonexistent.gguf", 4096, []) == 0
    assert resolve_n_gpu_layers(5, "/nonexistent.gguf", 4096, []) == 5


def test_resolution_with_a_device_reads_the_file(target_path, monkeypatch):
    size = os.path.getsize(target_path)
    kv, n_layer = offload._kv_and_layers(target_path, 4096)
    assert n_layer == 30                                  # SmolLM2-135M: 30 blocks
    assert kv == 2 * 4096 * 30 * 3 * (64 + 64)            # F16 K and V, 3 KV heads of 64
    monkeypatch.setattr(offload, "_dev_free_bytes", lambda devs: size + kv + offload.COMPUTE_RESERVE_BYTES)
    assert resolve_n_gpu_layers("auto", target_path, 4096, [1]) == ALL_LAYERS
    monkeypatch.setattr(offload, "_dev_free_bytes", lambda devs: offload.COMPUTE_RESERVE_BYTES + (size + kv) // 2)
    assert 0 < resolve_n_gpu_layers("auto", target_path, 4096, [1]) < n_layer
    assert resolve_n_gpu_layers("all", target_path, 4096, [1]) == ALL_LAYERS


def test_auto_is_the_default_and_resolves_on_load(target_path):
    from pyllama_dspark.llama.handles import Target
    from pyllama_dspark.speculative.costprofile import target_key

    assert ContextSettings().n_gpu_layers == "auto"
    gpu = bool(ll.llama_supports_gpu_offload()) and bool(__import__("pyllama_dspark.llama.rpc", fromlist=["x"])
                                                         .local_gpu_devices())
    with Target(target_path, ContextSettings(n_ctx=256)) as t:
        auto_key = target_key(t)
        resolved = t.settings.n_gpu_layers_resolved
        assert t.settings.placement() == resolved
    if not gpu:
        assert resolved == 0
        # nothing changes without a GPU: the same cost profile as -ngl 0
        with Target(target_path, ContextSettings(n_ctx=256, n_gpu_layers=0)) as t0:
            assert target_key(t0) == auto_key
    with Target(target_path, ContextSettings(n_ctx=256, n_gpu_layers=3)) as t3:
        assert t3.settings.n_gpu_layers_resolved == 3
        assert target_key(t3) != auto_key or gpu      # keyed by the placement


def test_draft_follows_ngl_unless_ngld():
    s = ContextSettings(n_gpu_layers=7, n_gpu_layers_resolved=7)
    d = s.for_draft()
    assert d.n_gpu_layers == 7 and d.n_gpu_layers_resolved is None
    assert ContextSettings(n_gpu_layers="auto", n_gpu_layers_draft=0).for_draft().n_gpu_layers == 0
    assert ContextSettings(n_gpu_layers="auto").for_draft().n_gpu_layers == "auto"


@pytest.mark.parametrize("cmd", ["run", "serve", "bench", "crosscheck", "profile", "calibrate", "bench-schedule"])
def test_every_command_takes_ngl_auto_by_default(cmd):
    from pyllama_dspark.cli.main import main as cli

    command = cli.get_command(click.Context(cli), cmd)
    opts = {p.name: p for p in command.params}
    assert "n_gpu_layers" in opts, f"{cmd} has no -ngl"
    assert opts["n_gpu_layers"].default == "auto"
    assert "-ngl" in opts["n_gpu_layers"].opts
    assert opts["n_gpu_layers"].type.convert("all", None, None) == "all"
    # llama.cpp's -bs (on) beside --no-backend-sampling (off); neither: auto (on when offloaded)
    bs = [p for p in command.params if p.name == "backend_sampling"]
    assert {o for p in bs for o in p.opts} >= {"-bs", "--backend-sampling", "--no-backend-sampling"}
    assert {p.flag_value for p in bs} == {"on", "off"}
    for argv, want in (([], None), (["-bs"], "on"), (["--no-backend-sampling"], "off")):
        got = command.make_context(cmd, list(argv) + _REQUIRED.get(cmd, []), resilient_parsing=True).params
        assert (got["backend_sampling"] or None) == want, (cmd, argv, got["backend_sampling"])


_REQUIRED = {"calibrate": ["-o", "x.json"]}


def test_llama_plugin_reads_llama_cpp_pythons_ngl():
    from pyllama_dspark.integrations.llama_plugin import _llama_ngl

    # llama-cpp-python: n_gpu_layers=-1 offloads every layer
    assert _llama_ngl(-1) == "all" and _llama_ngl(0) == 0 and _llama_ngl(12) == 12
