"""llama.cpp's RPC backend: the target split across two real ``ggml-rpc-server`` processes on
127.0.0.1 (built from the vendored sources by ``pyllama-dspark rpc-server``), ``-ngl 99``.

References: our own run with every layer local, llama-server with the same ``--rpc`` endpoints
(same tokens and per-step drafted/accepted counts), ``Llama``'s sampler-chain law at T > 0.
Faults: a closed port, a server that accepts and never answers, an unroutable address, and an
rpc-server killed mid-generation under ``run`` and under ``serve``: each a bounded, asserted
outcome.  Every RPC client runs in a process of its own (tests/rpc_worker.py, the CLI): an
rpc-server serves one client at a time and a client keeps its connection until it exits.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest

from first_tokens_law import law_check, two_token_law
from greedy_ref import TEST_THREADS
from serve_helpers import SESSION, ServeProcess, free_port
from pyllama_dspark.speculative.sampling_params import SamplingParams
from pyllama_dspark.upstream.llama_server import LlamaServer
from pyllama_dspark.upstream.llama_server_build import ensure_llama_server
from pyllama_dspark.upstream.rpc_build import ensure_rpc

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "pyllama_dspark.cli.main"]
SHIPPED = str(ROOT / "pyllama_dspark" / "data" / "SmolLM2-135M-Instruct-DSpark.gguf")
N_PREDICT = 32
BOUND_S = 60   # every fault ends within this


class RpcServer:
    """``pyllama-dspark rpc-server -p PORT -t 1``, ready when it accepts connections."""

    def __init__(self, log_dir: Path):
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.log = open(log_dir / f"rpc-{self.port}.log", "wb")
        self.proc = subprocess.Popen(CLI + ["rpc-server", "-p", str(self.port), "-t", "1"], stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(ROOT))
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, f"rpc-server exited: {self.proc.returncode}"
            try:
                with closing(socket.create_connection(("127.0.0.1", self.port), timeout=1)):
                    break   # the server serves the next client after this one hangs up
            except OSError:
                assert time.monotonic() < deadline, "rpc-server not listening after 60 s"
                time.sleep(0.1)

    def clients(self) -> int:
        """Client connections it has accepted so far (its log)."""
        self.log.flush()
        return (self.log_dir / f"rpc-{self.port}.log").read_text(errors="replace").count("Accepted client connection")

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def rpc_binaries():
    return ensure_rpc()


@pytest.fixture
def pair(rpc_binaries, tmp_path):
    servers = [RpcServer(tmp_path), RpcServer(tmp_path)]
    yield servers
    for s in servers:
        s.kill()


@pytest.fixture(scope="module")
def prompts(target_path):
    from pyllama_dspark.decode.api import Speculator

    with Speculator(target_path, n_threads=TEST_THREADS, schedule="off") as sp:
        return [sp.chat_prompt([{"role": "user", "content": q}]).tokens
                for q in ("Write a short poem about the sea.", "List three uses of copper.")]


def _worker(tmp_path: Path, **job):
    job.setdefault("threads", TEST_THREADS)
    path, out = tmp_path / f"job-{job['mode']}.json", tmp_path / f"out-{job['mode']}-{bool(job.get('rpc'))}"
    out = out.with_suffix(".npz" if job["mode"] == "features" else ".json")
    path.write_text(json.dumps(job))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "rpc_worker.py"), str(path), str(out)],
                       capture_output=True, text=True, timeout=600, cwd=str(ROOT),
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])))
    assert r.returncode == 0, r.stderr[-3000:]
    return np.load(out) if job["mode"] == "features" else json.loads(out.read_text())


def _endpoints(pair):
    return ",".join(s.endpoint for s in pair)


def test_greedy_over_rpc_equals_local_and_llama_server(target_path, prompts, pair, tmp_path):
    common = dict(mode="greedy", target=target_path, draft=SHIPPED, prompts=prompts, n_predict=N_PREDICT)
    local = _worker(tmp_path, **common)
    before = [s.clients() for s in pair]
    remote = _worker(tmp_path, **common, rpc=_endpoints(pair), ngl=99)
    assert all(s.clients() > b for s, b in zip(pair, before)), "our run did not use the rpc-servers"
    for lo, re_ in zip(local, remote):
        assert re_["tokens"] == lo["tokens"]
        assert re_["steps"] == lo["steps"]
    assert sum(r["totals"][1] for r in remote) > 0, "nothing accepted: the per-step comparison is weak"
    # llama.cpp's own driver on the same rpc-servers (our client has exited: one client at a time)
    before = [s.clients() for s in pair]
    with LlamaServer(ensure_llama_server(), target_path, SHIPPED, n_max=7, ctx=1024, threads=TEST_THREADS,
                     n_batch=512, n_ubatch=512, extra_args=["--rpc", _endpoints(pair), "-ngl", "99"]) as srv:
        for prompt, re_ in zip(prompts, remote):
            cpp = srv.complete(prompt, N_PREDICT)
            assert cpp["tokens"] == re_["tokens"]
            assert [tuple(s[:2]) for s in cpp["steps"]] == [tuple(s) for s in re_["steps"]]
    assert all(s.clients() > b for s, b in zip(pair, before)), "llama-server did not use the rpc-servers"


def test_draft_local_target_remote(target_path, prompts, pair, tmp_path):
    """-ngld 0: the draft (and its Markov head) stays local, the target is remote."""
    common = dict(mode="greedy", target=target_path, draft=SHIPPED, prompts=prompts[:1], n_predict=N_PREDICT)
    local = _worker(tmp_path, **common)
    remote = _worker(tmp_path, **common, rpc=_endpoints(pair), ngl=99, ngld=0)
    assert remote == local


def test_captured_features_over_rpc_equal_local(target_path, dspark_draft_path, prompts, pair, tmp_path):
    common = dict(mode="features", target=target_path, draft=dspark_draft_path, prompts=prompts[:1])
    local = _worker(tmp_path, **common)
    remote = _worker(tmp_path, **common, rpc=_endpoints(pair), ngl=99)
    lf, rf = local["features"], remote["features"]
    assert lf.shape == rf.shape and lf.size > 0
    # the same kernels on the same CPU, in another process: equal up to the batch-shape rounding
    rms = float(np.sqrt(np.mean(lf.astype(np.float64) ** 2)))
    print(f"captured features: max |local - rpc| = {float(np.abs(lf - rf).max()):.3g} (rms |f| {rms:.3g})")
    np.testing.assert_allclose(rf, lf, rtol=1e-3, atol=1e-3 * rms)
    assert np.array_equal(local["logits"].argmax(1), remote["logits"].argmax(1))


def test_sampling_over_rpc_follows_the_target_law(target_path, dspark_draft_path, llama_refs, pair, tmp_path):
    params = dict(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)
    llm = llama_refs.llm
    prompt = llm.tokenize(b"The capital of France is", add_bos=True, special=True)
    law = two_token_law(llm, prompt, SamplingParams(**params))
    wrong = two_token_law(llm, prompt, SamplingParams(**dict(params, temperature=2.0)))
    got = _worker(tmp_path, mode="law", target=target_path, draft=dspark_draft_path, prompts=[prompt],
                      params=params, n=240, rpc=_endpoints(pair), ngl=99)
    law_check([tuple(s) for s in got["samples"]], law, wrong, "RPC (-ngl 99, two rpc-servers), random DSpark draft")
    # the Markov head stays on this machine: RPC devices call themselves GPUs, but a round trip per
    # drafted position for a [rank x n_vocab] product would cost more than it computes
    assert got["markov_backend"] == "CPU", got["markov_backend"]


# ---- faults ----------------------------------------------------------------------------------------

def _run(args, timeout=BOUND_S):
    t0 = time.monotonic()
    r = subprocess.run(CLI + ["run", "-p", "hi", "-n", "4", "--raw", "-t", "1", "-ngl", "99"] + args,
                       capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    return r, time.monotonic() - t0


def test_refused_endpoint_is_a_clear_error(rpc_binaries):
    r, dt = _run(["--rpc", f"127.0.0.1:{free_port()}"])
    assert r.returncode == 1 and "connection refused" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_silent_endpoint_times_out_with_a_clear_error(rpc_binaries):
    """A port that accepts and never answers (an rpc-server busy with another client looks so)."""
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        r, dt = _run(["--rpc", f"127.0.0.1:{s.getsockname()[1]}"])
    assert r.returncode == 1 and "did not answer" in r.stderr and "one client at a time" in r.stderr, r.stderr
    assert dt < 30


def test_unroutable_endpoint_is_bounded(rpc_binaries):
    r, dt = _run(["--rpc", "192.0.2.1:50052"])   # TEST-NET-1: nothing answers there
    assert r.returncode == 1 and ("unreachable" in r.stderr or "refused" in r.stderr), r.stderr
    assert "Traceback" not in r.stderr


def test_bad_endpoint_is_a_usage_error():
    r, _ = _run(["--rpc", "localhost"])
    assert r.returncode == 2 and "host:port" in r.stderr


def test_rpc_server_killed_mid_run_ends_run(target_path, pair):
    proc = subprocess.Popen(CLI + ["run", "-m", target_path, "-p", "Tell me a long story.", "-n", "100000",
                                   "--ignore-eos", "-t", "1", "-ngl", "99", "--rpc", _endpoints(pair), "-c", "8192"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(ROOT))
    first = proc.stdout.read(8)   # generating
    assert first, proc.stderr.read().decode()[-2000:]
    pair[1].kill()
    try:
        _, err = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("run hung after its rpc-server died")
    last = err.decode(errors="replace").strip().splitlines()[-1]
    assert proc.returncode == 1, (proc.returncode, last)
    assert "fatal: llama.cpp aborted" in last and "RPC servers in use" in last, last


def test_rpc_server_killed_mid_request_ends_serve(target_path, pair, tmp_path):
    srv = ServeProcess(target_path, SHIPPED, tmp_path / "serve.log",
                       extra=["-ngl", "99", "--rpc", _endpoints(pair)])
    try:
        body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 100000,
                "stream": True, "ignore_eos": True}
        outcome = {}

        def client():
            try:
                with SESSION.post(srv.url + "/v1/chat/completions", json=body, stream=True, timeout=BOUND_S) as r:
                    outcome["status"] = r.status_code
                    outcome["chunks"] = sum(1 for _ in r.iter_lines())
            except Exception as e:  # noqa: BLE001 - a cut connection is the expected outcome
                outcome["error"] = type(e).__name__

        th = threading.Thread(target=client)
        th.start()
        time.sleep(3)
        pair[0].kill()
        th.join(BOUND_S + 5)
        assert not th.is_alive(), "the client hung"
        assert srv.proc.wait(BOUND_S) == 1
        last = srv.log_text().strip().splitlines()[-1]
        assert "fatal: llama.cpp aborted" in last and "RPC servers in use" in last, last
        assert outcome, outcome
    finally:
        srv.stop()


def test_tensor_split_places_the_layers(target_path, pair):
    """-ts 1,0: every offloaded layer on the first server; 1,1: both get layers (llama.cpp's log)."""
    for split, want in (("1,0", (True, False)), ("1,1", (True, True))):
        r = subprocess.run(CLI + ["run", "-m", target_path, "-p", "hi", "-n", "2", "--raw", "-t", "1", "-v", "-ngl", "99",
                                  "--rpc", _endpoints(pair), "-ts", split],
                           capture_output=True, text=True, timeout=BOUND_S, cwd=str(ROOT))
        assert r.returncode == 0, r.stderr[-2000:]
        got = tuple(f"assigned to device RPC{i}," in r.stderr for i in (0, 1))
        assert got == want, (split, got)


def test_bad_tensor_split_is_a_usage_error():
    r, _ = _run(["-ts", "1,x"])
    assert r.returncode == 2 and "-ts" in r.stderr


def test_no_loadable_module_says_what_happens(tmp_path):
    """Only a static ggml-rpc-server (the fallback build): --rpc has no module to load here."""
    from pyllama_dspark.upstream.rpc_build import RpcUnavailable, rpc_module

    with pytest.raises(RpcUnavailable, match="no loadable module"):
        rpc_module(tmp_path, build=False)
