"""Interleaved conversations on few slots: the RAM prompt cache (``--cache-ram``) of ``serve``
against llama-server's, with the same draft.

    python bench/prompt_cache_trace.py [--slots 2] [--convs 6] [--turns 8] [-n 24] [--threads 2]
        [-c 8192] [--rounds 2] [--out FILE]

``--convs`` conversations of ``--turns`` turns are sent in turn (conversation 1, 2, ..., then
their next turns), one request at a time, streamed, greedy, ``-n`` tokens per reply
(``ignore_eos``), to servers with ``-np --slots``:

* llama-server ``-cram 8192`` with the shipped drafter (``--spec-type draft-dspark``);
* ``pyllama-dspark serve`` with the same drafter, ``--cache-ram 8192`` and ``--cache-ram 0``.

Per server: the time to the first content chunk (TTFT) of the returning turns (turn 2 on), mean
and median; the wall-clock time of the whole trace; the mean ``timings.cache_n``, ``prompt_n``
and ``prompt_ms`` of the returning turns (how much of each was reused, how much prefilled, and
the server's own prompt time: TTFT minus it is the request's path outside the prefill).  Rounds alternate the
servers; the medians over rounds are printed side by side with the ratios ours / llama-server's,
and every raw number goes to ``--out`` (JSON).  Run it on an idle machine: llama.cpp's threads
spin-wait.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_vs_llama_server import OurServer, chat, chat_body   # noqa: E402  (the sibling benchmark)

from pyllama_dspark.paths import default_draft, default_target   # noqa: E402
from pyllama_dspark.upstream.llama_server import LlamaServer, _free_port   # noqa: E402
from pyllama_dspark.upstream.llama_server_build import ensure_llama_server   # noqa: E402

QUESTIONS = ["Name a fruit and describe it.", "Why that one?", "Tell me one more fact about it.",
             "Say it again, shorter.", "Name a colour you like.", "Why?", "Give an example of it in nature.",
             "Thanks. One last word?"]


class TheirServer(LlamaServer):
    def __init__(self, binary, target, draft, *, n_slots, ctx, threads, log_dir, cache_ram):
        super().__init__(binary, target, draft, ctx=ctx, threads=threads, n_batch=512, n_ubatch=512,
                         port=_free_port(), log_path=log_dir / "llama-server.log", trace=False,
                         extra_args=["-np", str(n_slots), "-cram", str(cache_ram)])
        self.name, self.url = f"llama-server -cram {cache_ram}", self.base_url


def trace(url: str, convs: int, turns: int, n: int, tag: int) -> dict:
    msgs = [[{"role": "system", "content": f"Session {tag}. You are assistant number {c}. Answer briefly."}]
            for c in range(convs)]
    ttft, cache_n, prompt_n, prompt_ms = [], [], [], []
    t0 = time.perf_counter()
    for turn in range(turns):
        for c in range(convs):
            msgs[c].append({"role": "user", "content": QUESTIONS[(c + turn) % len(QUESTIONS)]})
            r = chat(url, chat_body(msgs[c], n, stream=True))
            if turn:
                ttft.append(r["ttft_s"])
                cache_n.append(r["timings"].get("cache_n", 0))
                prompt_n.append(r["timings"].get("prompt_n", 0))
                prompt_ms.append(r["timings"].get("prompt_ms", 0.0))
            msgs[c].append({"role": "assistant", "content": r["content"]})
    return {"wall_s": time.perf_counter() - t0, "ttft_s": ttft, "cache_n": cache_n, "prompt_n": prompt_n,
            "prompt_ms": prompt_ms}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--convs", type=int, default=6)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("-n", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    target, draft = default_target(), str(default_draft())
    log_dir = Path(tempfile.mkdtemp(prefix="cache-trace-"))
    servers = {
        "llama-server -cram 8192": TheirServer(ensure_llama_server(), target, draft, n_slots=a.slots, ctx=a.ctx,
                                               threads=a.threads, log_dir=log_dir, cache_ram=8192),
    }
    for ram in (8192, 0):
        s = OurServer(f"ours-cram{ram}", target, n_slots=a.slots, ctx=a.ctx, threads=a.threads, log_dir=log_dir,
                      draft=draft, schedule="auto")
        s.cmd += ["--cache-ram", str(ram)]
        servers[f"ours --cache-ram {ram}"] = s
    for name, s in servers.items():
        print(f"$ {' '.join(s.command())}", flush=True)
    runs = {k: [] for k in servers}
    try:
        for s in servers.values():
            s.start()
        for r in range(a.rounds):
            order = list(servers) if r % 2 == 0 else list(servers)[::-1]
            for k in order:
                # a fresh conversation set per round (another system prompt): nothing cached yet
                res = trace(servers[k].url, a.convs, a.turns, a.n, r)
                runs[k].append(res)
                print(f"  round {r + 1} {k}: wall {res['wall_s']:.2f} s, returning TTFT mean "
                      f"{statistics.mean(res['ttft_s']) * 1e3:.1f} ms", flush=True)
    finally:
        for s in servers.values():
            try:
                s.stop()
            except Exception as e:
                print(f"stopping {s}: {e}", file=sys.stderr)
    ref = "llama-server -cram 8192"

    def med(k, f):
        return statistics.median(f(x) for x in runs[k])
    rows = []
    for k in servers:
        wall = med(k, lambda x: x["wall_s"])
        ttft = med(k, lambda x: statistics.mean(x["ttft_s"])) * 1e3
        ttft_med = med(k, lambda x: statistics.median(x["ttft_s"])) * 1e3
        rows.append([k, f"{ttft:.1f}", f"{ttft_med:.1f}", f"{wall:.2f}",
                     f"{med(k, lambda x: statistics.mean(x['cache_n'])):.0f}",
                     f"{med(k, lambda x: statistics.mean(x['prompt_n'])):.1f}",
                     f"{med(k, lambda x: statistics.mean(x['prompt_ms'])):.1f}",
                     f"{ttft / (med(ref, lambda x: statistics.mean(x['ttft_s'])) * 1e3):.2f}",
                     f"{wall / med(ref, lambda x: x['wall_s']):.2f}"])
    print(f"\n{a.convs} conversations x {a.turns} turns, -np {a.slots}, {a.n} tokens per reply, -t {a.threads}, "
          f"median of {a.rounds} rounds:")
    print(tabulate(rows, headers=["server", "TTFT mean ms", "TTFT median ms", "wall s", "cache_n", "prompt_n", "prompt_ms",
                                  "TTFT / llama-server", "wall / llama-server"]))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "runs": runs,
                                           "commands": {k: s.command() for k, s in servers.items()}}, indent=1))


if __name__ == "__main__":
    main()
