"""``pyllama-dspark serve`` against llama.cpp's ``llama-server``, both driven over HTTP.

    python bench/serve_vs_llama_server.py [--only throughput,cache,json] [--rounds 5] [--threads 2]
        [--requests 2] [-n 64] [--turns 8] [--turn-tokens 32] [--json-tokens 128] [-c 8192] [--out FILE]

Both servers run on 127.0.0.1 with the same target, ``-t``, ``-c`` (the total, split across the
``-np`` slots by both) and ``-np``, are sent greedy requests (temperature 0) through
``/v1/chat/completions`` (each applies the model's chat template) by ``requests`` sessions
(one per client thread, ``trust_env`` off), are started once per configuration and kept up while
rounds alternate between them (median over rounds).  Sections (``--only``):

* throughput: no draft; distinct prompts, ``cache_prompt`` false, ``max_tokens`` -n with
  ``ignore_eos`` (exactly -n tokens each); completion tokens per wall-clock second of a round, at
  ``-np 1`` with one client and at ``-np C`` with C concurrent clients (``--clients``), each client
  sending ``--requests`` requests one after another; plus the mean ``timings.prompt_n`` /
  ``prompt_ms`` (prefill) and ``predicted_per_second`` (decode) of the requests.
* cache: a ``--turns`` chat (each turn appends the assistant's reply and a new user message,
  ``--turn-tokens`` per reply, ``ignore_eos``), streamed, at ``-np 1``, with ``cache_prompt`` true
  and false on each server: time to the first content chunk (TTFT) and total time per turn,
  ``timings.cache_n`` per turn, the last turn's TTFT ratio cached / uncached.  Then the multi-turn
  mix: C clients each running its own chat at once at ``-np C``, cache on: completion tok/s.
* json: tok/s under a JSON-schema grammar (``json_schema`` in the request, ``--json-tokens`` at
  most, stopping where the object ends) on our server with the shipped drafter under
  ``--schedule auto`` and ``--schedule off`` and without a draft, llama-server without a draft as
  a reference; ratio auto / no draft (goal >= 0.97).

Prints the server command lines first, a table per section, and writes every raw number to
``--out`` (JSON).  Run it on an idle machine: llama.cpp's threads spin-wait.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import requests
from tabulate import tabulate

from pyllama_dspark.paths import cache_dir, default_draft, default_target
from pyllama_dspark.prompts import load_prompts
from pyllama_dspark.upstream.llama_server import LlamaServer, LlamaServerError, _free_port
from pyllama_dspark.upstream.llama_server_build import ensure_llama_server

REPO = Path(__file__).resolve().parent.parent
SECTIONS = ("throughput", "cache", "json")
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
          "required": ["name", "age", "tags"]}
JSON_ASK = ("Describe the author of this request as a JSON object with a name, an age and up to four "
            "tags:\n\n{}")


class BenchError(RuntimeError):
    """A server refused a request or died."""


# -- servers ----------------------------------------------------------------------------------------

class OurServer:
    """``pyllama-dspark serve`` as a child process (this source tree's package: run with cwd = repo)."""

    def __init__(self, name: str, target: str, *, n_slots: int, ctx: int, threads: int, log_dir: Path,
                 draft: Optional[str] = None, schedule: Optional[str] = None):
        self.name, self.port = name, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "pyllama_dspark.cli.main", "serve", "-m", target, "--host", "127.0.0.1",
                    "--port", str(self.port), "-np", str(n_slots), "-c", str(ctx), "-t", str(threads), "--temp", "0"]
        if draft is not None:
            self.cmd += ["-md", draft]
        if schedule is not None:
            self.cmd += ["--schedule", schedule]
        self.log_path = log_dir / f"{name}.log"
        self.proc: Optional[subprocess.Popen] = None

    def command(self) -> List[str]:
        return list(self.cmd)

    def start(self, timeout: float = 900.0) -> None:
        logf = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=str(REPO), env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        logf.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name} exited with {self.proc.returncode}:\n{self._tail()}")
            try:
                if session().get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise BenchError(f"{self.name} not ready after {timeout:.0f} s:\n{self._tail()}")

    def _tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


class TheirServer(LlamaServer):
    """llama-server through :class:`LlamaServer`, with ``-np N`` in place of its one slot."""

    def __init__(self, name: str, binary: Path, target: str, *, n_slots: int, ctx: int, threads: int, log_dir: Path):
        super().__init__(binary, target, None, ctx=ctx, threads=threads, n_batch=512, n_ubatch=512, flash_attn="auto",
                         port=_free_port(), log_path=log_dir / f"{name}.log", trace=False, startup_timeout=600.0)
        self.name, self.n_slots, self.url = name, n_slots, self.base_url

    def command(self) -> List[str]:
        cmd = super().command()
        cmd[cmd.index("-np") + 1] = str(self.n_slots)
        return cmd


class Fleet:
    """The server configurations of a run: built up front (command lines), started on first use."""

    def __init__(self, a, binary: Optional[Path], log_dir: Path):
        self.a, self.binary, self.log_dir = a, binary, log_dir
        self.servers: Dict[str, Any] = {}
        self.started: List[Any] = []

    def declare(self, key: str) -> None:
        if key in self.servers:
            return
        a, kw = self.a, dict(ctx=self.a.ctx, threads=self.a.threads, log_dir=self.log_dir)
        side, np_, mode = key.split(":")
        if side == "llama":
            self.servers[key] = TheirServer(f"llama-server-np{np_}", self.binary, a.target, n_slots=int(np_), **kw)
        else:
            draft = None if mode == "nodraft" else a.draft
            sched = None if mode == "nodraft" else mode
            self.servers[key] = OurServer(f"ours-np{np_}-{mode}", a.target, n_slots=int(np_), draft=draft,
                                          schedule=sched, **kw)

    def __getitem__(self, key: str):
        s = self.servers[key]
        if s not in self.started:
            print(f"  starting {s.name} ...", flush=True)
            self.started.append(s)
            s.start()
            chat(s.url, chat_body([{"role": "user", "content": "Hello"}], 8))   # warm-up, not timed
        return s

    def stop_all(self) -> None:
        for s in reversed(self.started):
            try:
                s.stop()
            except Exception as e:  # keep stopping the others
                print(f"  stopping {s.name}: {e}", file=sys.stderr)


# -- HTTP -----------------------------------------------------------------------------------------------

_local = threading.local()


def session() -> requests.Session:
    s = getattr(_local, "session", None)
    if s is None:
        s = _local.session = requests.Session()
        s.trust_env = False   # never route 127.0.0.1 through a proxy from the environment
    return s


def chat_body(messages, n: int, *, cache: bool = True, ignore_eos: bool = True, stream: bool = False, **extra):
    return {"messages": messages, "max_tokens": n, "temperature": 0.0, "ignore_eos": ignore_eos,
            "cache_prompt": cache, "stream": stream, **extra}


def _sse_lines(resp: requests.Response):
    buf = b""
    for piece in resp.iter_content(chunk_size=None):   # as the chunks arrive, not 512-byte reads
        buf += piece
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode("utf-8", errors="replace").rstrip("\r")


def chat(url: str, body: dict) -> Dict[str, Any]:
    """One /v1/chat/completions request: wall_s, ttft_s (streaming), content, n (completion tokens), timings."""
    t0 = time.perf_counter()
    r = session().post(url + "/v1/chat/completions", json=body, stream=bool(body.get("stream")), timeout=900)
    if r.status_code != 200:
        raise BenchError(f"{url}: HTTP {r.status_code}: {r.text[:600]}")
    if not body.get("stream"):
        j = r.json()
        return {"wall_s": time.perf_counter() - t0, "ttft_s": None, "content": j["choices"][0]["message"]["content"],
                "n": int(j["usage"]["completion_tokens"]), "timings": j.get("timings") or {}}
    ttft, parts, timings = None, [], {}
    for line in _sse_lines(r):
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        ev = json.loads(data)
        if "error" in ev:
            raise BenchError(f"{url}: stream error {ev['error']}")
        for ch in ev.get("choices") or ():
            c = (ch.get("delta") or {}).get("content")
            if c:
                ttft = time.perf_counter() - t0 if ttft is None else ttft
                parts.append(c)
        timings = ev.get("timings") or timings
    r.close()
    return {"wall_s": time.perf_counter() - t0, "ttft_s": ttft, "content": "".join(parts),
            "n": int(timings.get("predicted_n", 0)), "timings": timings}


def concurrently(fns: List[Callable[[], list]]):
    """Run the client functions at once; (wall seconds, their results)."""
    with ThreadPoolExecutor(len(fns)) as ex:
        t0 = time.perf_counter()
        futs = [ex.submit(f) for f in fns]
        res = [f.result() for f in futs]
        return time.perf_counter() - t0, res


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else float("nan")


def prompt_pool(max_chars: int) -> List[str]:
    """First turns of the packaged prompt sets, at most max_chars long, one file after another in turn."""
    by_src: Dict[str, List[str]] = {}
    for it in load_prompts():
        if len(it.turns[0]) <= max_chars:
            by_src.setdefault(it.source, []).append(it.turns[0])
    out, lists = [], list(by_src.values())
    for i in range(max(len(v) for v in lists)):
        out += [v[i] for v in lists if i < len(v)]
    return out


def order_for(keys: List[str], r: int) -> List[str]:
    k = r % len(keys)
    return keys[k:] + keys[:k]


# -- sections -----------------------------------------------------------------------------------------

def throughput(a, fleet: Fleet, out: dict) -> None:
    pool = prompt_pool(1500)
    rows = []
    for np_, clients in sorted({(1, 1), (a.clients, a.clients)}):
        sides = {"ours": fleet[f"ours:{np_}:nodraft"], "llama-server": fleet[f"llama:{np_}:-"]}
        rec = {s: {"tok_s": [], "requests": []} for s in sides}
        for r in range(a.rounds):
            base = r * clients * a.requests
            jobs = [[pool[(base + c * a.requests + k) % len(pool)] for k in range(a.requests)] for c in range(clients)]
            for side in order_for(list(sides), r):
                url = sides[side].url

                def client(ps, url=url):
                    return [chat(url, chat_body([{"role": "user", "content": p}], a.n_predict, cache=False))
                            for p in ps]

                wall, res = concurrently([lambda ps=ps: client(ps) for ps in jobs])
                flat = [x for cl in res for x in cl]
                rec[side]["tok_s"].append(sum(x["n"] for x in flat) / wall)
                rec[side]["requests"] += [{"n": x["n"], "wall_s": x["wall_s"], "timings": x["timings"]} for x in flat]
        out[f"np{np_}_clients{clients}"] = rec
        ref = med(rec["llama-server"]["tok_s"])
        for side, v in rec.items():
            t = [x["timings"] for x in v["requests"]]
            rows.append([f"-np {np_}, {clients} client(s)", side, med(v["tok_s"]), med(v["tok_s"]) / ref,
                         mean([x.get("prompt_n") for x in t]), mean([x.get("prompt_ms") for x in t]),
                         mean([x.get("predicted_per_second") for x in t]), sum(x["n"] for x in v["requests"])])
    print(f"\n== throughput: no draft, cache_prompt false, {a.n_predict} tokens (ignore_eos), "
          f"{a.rounds} rounds x {a.requests} requests per client")
    print(tabulate(rows, headers=["config", "server", "tok/s (wall, median)", "vs llama-server",
                                  "mean prompt_n", "mean prompt_ms", "mean predicted/s", "tokens"], floatfmt=".2f"))


def run_chat(url: str, users: List[str], n: int, *, cache: bool, stream: bool) -> List[Dict[str, Any]]:
    msgs, turns = [], []
    for u in users:
        msgs.append({"role": "user", "content": u})
        x = chat(url, chat_body(list(msgs), n, cache=cache, stream=stream))
        msgs.append({"role": "assistant", "content": x["content"]})
        t = x["timings"]
        turns.append({"ttft_s": x["ttft_s"], "wall_s": x["wall_s"], "n": x["n"], "cache_n": t.get("cache_n"),
                      "prompt_n": t.get("prompt_n"), "prompt_ms": t.get("prompt_ms")})
    return turns


def cache(a, fleet: Fleet, out: dict) -> None:
    pool = prompt_pool(300)
    servers = {"ours": fleet["ours:1:nodraft"], "llama-server": fleet["llama:1:-"]}
    configs = [(s, c) for s in servers for c in (True, False)]
    runs: Dict[str, List[list]] = {f"{s}/{'cached' if c else 'uncached'}": [] for s, c in configs}
    for r in range(a.rounds):
        users = [pool[(r * a.turns + i) % len(pool)] for i in range(a.turns)]
        for s, c in order_for(configs, r):
            runs[f"{s}/{'cached' if c else 'uncached'}"].append(
                run_chat(servers[s].url, users, a.turn_tokens, cache=c, stream=True))
    out["chat"] = runs
    names = list(runs)

    def per_turn(name, field, scale=1.0):
        return [med([rnd[i][field] * scale if rnd[i][field] is not None else None for rnd in runs[name]])
                for i in range(a.turns)]

    ttft = {k: per_turn(k, "ttft_s", 1e3) for k in names}
    total = {k: per_turn(k, "wall_s", 1e3) for k in names}
    cn = {k: per_turn(k, "cache_n") for k in names if k.endswith("/cached")}
    pn = {k: per_turn(k, "prompt_n") for k in names}
    rows = [[i + 1] + [ttft[k][i] for k in names] + [total[k][i] for k in names] + [cn[k][i] for k in cn]
            + [pn[k][i] for k in names if k.endswith("/cached")] for i in range(a.turns)]
    print(f"\n== cache: {a.turns}-turn chat at -np 1, {a.turn_tokens} tokens per reply, streamed, "
          f"median of {a.rounds} rounds (ms)")
    print(tabulate(rows, headers=["turn"] + [f"TTFT {k}" for k in names] + [f"total {k}" for k in names]
                   + [f"cache_n {k.split('/')[0]}" for k in cn] + [f"prompt_n {k.split('/')[0]}" for k in cn],
                   floatfmt=".1f"))
    out["ttft_ratio_last_turn"] = {}
    for s in servers:
        ratio = ttft[f"{s}/cached"][-1] / ttft[f"{s}/uncached"][-1]
        out["ttft_ratio_last_turn"][s] = ratio
        print(f"turn {a.turns} TTFT cached / uncached, {s}: {ratio:.3f}")

    # multi-turn mix: C clients, each its own chat, at -np C, cache on
    sides = {"ours": fleet[f"ours:{a.clients}:nodraft"], "llama-server": fleet[f"llama:{a.clients}:-"]}
    mix = {s: {"tok_s": [], "chats": []} for s in sides}
    for r in range(a.rounds):
        base = (a.rounds + r) * a.clients * a.turns
        users = [[pool[(base + c * a.turns + i) % len(pool)] for i in range(a.turns)] for c in range(a.clients)]
        for s in order_for(list(sides), r):
            url = sides[s].url
            wall, res = concurrently([lambda u=u, url=url: run_chat(url, u, a.turn_tokens, cache=True, stream=False)
                                      for u in users])
            mix[s]["tok_s"].append(sum(t["n"] for ch in res for t in ch) / wall)
            mix[s]["chats"].append(res)
    out["multi_turn_mix"] = mix
    ref = med(mix["llama-server"]["tok_s"])
    rows = []
    for s, v in mix.items():
        turns = [t for rnd in v["chats"] for ch in rnd for t in ch]
        rows.append([s, med(v["tok_s"]), med(v["tok_s"]) / ref, mean([t["cache_n"] for t in turns]),
                     mean([t["prompt_n"] for t in turns])])
    print(f"\n== multi-turn mix: {a.clients} clients x {a.turns}-turn chats at -np {a.clients}, cache on")
    print(tabulate(rows, headers=["server", "tok/s (wall, median)", "vs llama-server", "mean cache_n",
                                  "mean prompt_n"], floatfmt=".2f"))


def json_section(a, fleet: Fleet, out: dict) -> None:
    pool = prompt_pool(400)
    cfg = {}
    if a.draft:
        cfg["ours draft, --schedule auto"] = "ours:1:auto"
        cfg["ours draft, --schedule off"] = "ours:1:off"
    else:
        print("no shipped drafter in this install: json section without draft configurations")
    cfg["ours no draft"] = "ours:1:nodraft"
    cfg["llama-server no draft"] = "llama:1:-"
    rec: Dict[str, Dict[str, Any]] = {k: {"tok_s": [], "requests": [], "error": None} for k in cfg}
    for r in range(a.rounds):
        ps = [JSON_ASK.format(pool[(r * a.requests + k) % len(pool)]) for k in range(a.requests)]
        for name in order_for(list(cfg), r):
            if rec[name]["error"]:
                continue
            try:
                url = fleet[cfg[name]].url
                xs = [chat(url, chat_body([{"role": "user", "content": p}], a.json_tokens, cache=False,
                                          ignore_eos=False, json_schema=SCHEMA)) for p in ps]
            except (BenchError, LlamaServerError) as e:   # reported in the table, the others go on
                rec[name]["error"] = str(e)
                print(f"  {name}: {e}", file=sys.stderr)
                continue
            rec[name]["tok_s"].append(sum(x["n"] for x in xs) / sum(x["wall_s"] for x in xs))
            for x in xs:
                try:
                    json.loads(x["content"])
                    ok = True
                except ValueError:
                    ok = False
                rec[name]["requests"].append({"n": x["n"], "wall_s": x["wall_s"], "valid_json": ok,
                                              "content": x["content"], "timings": x["timings"]})
    out.update(rec)
    base = "ours no draft"
    ref_tok = med(rec[base]["tok_s"])
    ref_dec = mean([x["timings"].get("predicted_per_second") for x in rec[base]["requests"]])
    rows = []
    for name, v in rec.items():
        if v["error"]:
            rows.append([name, "error", "", "", "", "", ""])
            continue
        reqs = v["requests"]
        same = sum(x["content"] == y["content"] for x, y in zip(reqs, rec[base]["requests"]))
        dn = sum(x["timings"].get("draft_n", 0) or 0 for x in reqs)
        acc = sum(x["timings"].get("draft_n_accepted", 0) or 0 for x in reqs)
        dec = mean([x["timings"].get("predicted_per_second") for x in reqs])
        rows.append([name, med(v["tok_s"]), med(v["tok_s"]) / ref_tok, dec, dec / ref_dec,
                     f"{sum(x['valid_json'] for x in reqs)}/{len(reqs)}", f"{same}/{len(reqs)}",
                     f"{acc}/{dn}" if dn else "-"])
    print(f"\n== json: json_schema {{name, age, tags}}, at most {a.json_tokens} tokens, cache_prompt false, "
          f"{a.rounds} rounds x {a.requests} requests")
    print(tabulate(rows, headers=["config", "tok/s (wall, median)", "vs ours no draft", "mean predicted/s",
                                  "vs ours no draft", "valid JSON", "same text as no draft", "accepted/drafted"],
                   floatfmt=".3f"))
    auto = "ours draft, --schedule auto"
    if auto in rec and not rec[auto]["error"] and not rec[base]["error"]:
        ratio = med(rec[auto]["tok_s"]) / ref_tok
        out["ratio_auto_vs_nodraft"] = ratio
        print(f"constrained tok/s, --schedule auto / no draft: {ratio:.3f} (goal >= 0.97)")


# -- main -----------------------------------------------------------------------------------------------

NEEDS = {"throughput": lambda a: [f"{s}:{n}:{m}" for n in (1, a.clients)
                                  for s, m in (("ours", "nodraft"), ("llama", "-"))],
         "cache": lambda a: [f"{s}:{n}:{m}" for n in (1, a.clients) for s, m in (("ours", "nodraft"), ("llama", "-"))],
         "json": lambda a: (["ours:1:auto", "ours:1:off"] if a.draft else []) + ["ours:1:nodraft", "llama:1:-"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="target GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("-md", "--draft", default=None, help="drafter for the json section (default: the shipped one)")
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated: " + ",".join(SECTIONS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=2, help="requests per round per client")
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=8192, help="total context, split across the -np slots")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients = -np of the concurrent configs")
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--turn-tokens", type=int, default=32)
    ap.add_argument("--json-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="raw numbers (JSON); default: <cache>/bench/serve_vs_llama_server.json")
    ap.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    a = ap.parse_args()
    only = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in only if s not in SECTIONS]
    if bad or not only:
        ap.error(f"--only: unknown section(s) {bad}; choose from {','.join(SECTIONS)}")
    a.target = a.model or default_target()
    a.draft = a.draft or default_draft()
    out_path = Path(a.out) if a.out else cache_dir() / "bench" / "serve_vs_llama_server.json"
    log_dir = Path(a.log_dir) if a.log_dir else Path(tempfile.mkdtemp(prefix="serve-vs-llama-server-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    fleet = Fleet(a, ensure_llama_server(), log_dir)
    for s in only:
        for key in NEEDS[s](a):
            fleet.declare(key)
    print(f"target {a.target}\ndraft {a.draft}\n{a.threads} threads, -c {a.ctx}, sections {','.join(only)}, "
          f"{a.rounds} rounds; server logs in {log_dir}\nserver command lines:")
    for s in fleet.servers.values():
        print(f"  [{s.name}] {' '.join(s.command())}")
    results: Dict[str, Any] = {"args": {k: v for k, v in vars(a).items()},
                               "commands": {s.name: " ".join(s.command()) for s in fleet.servers.values()}, "errors": {}}
    run = {"throughput": throughput, "cache": cache, "json": json_section}
    try:
        for s in only:
            results[s] = {}
            try:
                run[s](a, fleet, results[s])
            except (BenchError, LlamaServerError) as e:
                results["errors"][s] = str(e)
                print(f"\n== {s}: FAILED: {e}", file=sys.stderr)
    finally:
        fleet.stop_all()
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(results, indent=1, default=str))
        print(f"\nraw numbers: {out_path}")


if __name__ == "__main__":
    main()
