"""tok/s with every layer local against the target on llama.cpp rpc-servers over loopback, no draft
and DSpark (the shipped SmolLM2 drafter), with the bytes that cross the RPC sockets per step.

    python bench/rpc_vs_local.py [--prompts 3] [--repeats 3] [-n 96] [--servers 2] [--threads 1]

Each configuration runs in a process of its own (one RPC client per rpc-server at a time), greedy,
interleaved over prompts and repeats: local / --rpc, no draft / DSpark with the fixed block
(every draft verified: drafting forced, so the draft's traffic shows) and with ``auto``.  The
bytes are the client's traffic on its connections to the rpc-servers, from the kernel's counters
(``TCP_INFO``) around each generation.  The rpc-servers get ``-t THREADS`` each,
the client the same, so both sides compute on as many cores.  Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from contextlib import closing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _io(ports):
    """(bytes received, bytes sent) so far on this process's TCP connections to ``ports``
    (the kernel's tcp_info: tcpi_bytes_received at offset 128, tcpi_bytes_acked at 120)."""
    recv = sent = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.fromfd(int(fd), socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            continue
        with s:
            try:
                if s.getpeername()[1] not in ports:
                    continue
                info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 144)
            except OSError:
                continue
            sent += int.from_bytes(info[120:128], "little")
            recv += int.from_bytes(info[128:136], "little")
    return recv, sent


def child(cfg):
    """One configuration over all prompts: per-prompt tok/s, cycles and bytes."""
    from pyllama_dspark.decode.api import Speculator

    out = []
    ports = {int(ep.rpartition(":")[2]) for ep in (cfg["rpc"] or "").split(",") if ep}
    with Speculator(cfg["target"], cfg["draft"], n_threads=cfg["threads"], n_ctx=2048, n_gpu_layers=cfg["ngl"],
                    n_gpu_layers_draft=cfg["ngld"], rpc=cfg["rpc"], schedule=cfg["schedule"], n_max=7) as sp:
        sp.generate(cfg["prompts"][0], 8)   # warm (and auto's cost curve, cached)
        for p in cfg["prompts"]:
            r0, w0 = _io(ports)
            t0 = time.perf_counter()
            done = sp.generate(p, cfg["n"], ignore_eos=True)
            dt = time.perf_counter() - t0
            r1, w1 = _io(ports)
            st = done.stats
            out.append(dict(tps=len(done.tokens) / dt, tokens=len(done.tokens), cycles=st.cycles,
                            drafted=st.drafted, accepted=st.accepted, recv=r1 - r0, sent=w1 - w0))
    print(json.dumps(out))


def _free_port():
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_servers(n, threads):
    from pyllama_dspark.upstream.rpc_build import rpc_server_binary

    binary = str(rpc_server_binary())
    procs, eps = [], []
    for _ in range(n):
        port = _free_port()
        procs.append(subprocess.Popen([binary, "-p", str(port), "-t", str(threads)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        eps.append(f"127.0.0.1:{port}")
        for _ in range(100):
            try:
                with closing(socket.create_connection(("127.0.0.1", port), timeout=1)):
                    break
            except OSError:
                time.sleep(0.1)
    return procs, ",".join(eps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child:
        return child(json.loads(a.child))

    from pyllama_dspark.decode.api import Speculator
    from pyllama_dspark.paths import default_draft, default_target
    from pyllama_dspark.prompts import load_prompts

    target, draft = default_target(), default_draft()
    with Speculator(target, None, n_threads=a.threads, schedule="off") as sp:
        items = load_prompts(limit_per_file=1)[:a.prompts]
        prompts = [sp.chat_prompt([{"role": "user", "content": it.turns[0]}]).tokens for it in items]
        n_embd, n_vocab = sp.target.n_embd, sp.target.n_vocab
    procs, eps = _start_servers(a.servers, a.threads)
    try:
        configs = {}
        for where, rpc, ngl in (("local", None, 0), ("rpc", eps, 99)):
            for name, d, sched in (("no draft", None, "off"), ("dspark fixed", draft, "off"), ("dspark auto", draft, "auto")):
                configs[f"{where:5s} {name}"] = dict(target=target, draft=d, rpc=rpc, ngl=ngl, ngld=None,
                                                     schedule=sched, threads=a.threads, prompts=prompts, n=a.n)
        # the draft kept local (-ngld 0), the target remote
        configs["rpc   dspark fixed -ngld 0"] = dict(configs["rpc   dspark fixed"], ngld=0)
        runs = {k: [] for k in configs}
        names = list(configs)
        for rep in range(a.repeats):
            for k in names[rep % len(names):] + names[:rep % len(names)]:
                env = dict(os.environ, PYTHONPATH=ROOT)
                r = subprocess.run([sys.executable, __file__, "--child", json.dumps(configs[k])], capture_output=True,
                                   text=True, env=env, timeout=900)
                if r.returncode != 0:
                    raise SystemExit(f"{k}: {r.stderr[-2000:]}")
                runs[k] += json.loads(r.stdout.strip().splitlines()[-1])
                print(f"  rep {rep} {k}: done", file=sys.stderr)
    finally:
        for p in procs:
            p.kill()
    base = statistics.median(x["tps"] for x in runs["local no draft"])
    print(f"target {os.path.basename(target)} (n_embd {n_embd}, n_vocab {n_vocab}); {a.servers} rpc-servers on "
          f"127.0.0.1, -t {a.threads} each and in the client; {len(prompts)} prompts x {a.repeats} repeats, "
          f"{a.n} tokens, greedy")
    print(f"{'config':27s} {'tok/s':>7s} {'vs local':>8s} {'steps':>6s} {'KiB/step out':>12s} {'KiB/step in':>11s} "
          f"{'KiB/token':>9s}")
    for k, rs in runs.items():
        tps = statistics.median(x["tps"] for x in rs)
        steps = sum(x["cycles"] for x in rs)
        sent, recv, toks = sum(x["sent"] for x in rs), sum(x["recv"] for x in rs), sum(x["tokens"] for x in rs)
        print(f"{k:27s} {tps:7.1f} {tps / base:8.2f} {steps / len(rs):6.1f} {sent / max(steps, 1) / 1024:12.1f} "
              f"{recv / max(steps, 1) / 1024:11.1f} {(sent + recv) / max(toks, 1) / 1024:9.1f}")
    print(f"per verified row, the logits read back are n_vocab x 4 B = {n_vocab * 4 / 1024:.0f} KiB; a captured "
          f"feature row is n_embd x 4 B = {n_embd * 4 / 1024:.1f} KiB per captured layer")


if __name__ == "__main__":
    main()
