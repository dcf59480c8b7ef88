"""N ``pyllama-dspark serve`` replicas behind HAProxy on one machine (docs/scale-out.md).

    python deploy/replicas.py --replicas 2 [--port 8080] [--stats-port 8404] -m MODEL [-md DRAFT] [serve args...]

Starts the replicas on free 127.0.0.1 ports (every argument this script does not know goes to each
``serve``; ``--host`` / ``--port`` are set per replica), waits for their ``/health``, writes
``deploy/haproxy.cfg`` with their ``server`` lines into a temporary directory, checks it, runs
``haproxy -f cfg -db`` in the foreground and prints the URL.  Ctrl-C or SIGTERM stops HAProxy and
then every replica; children also get SIGTERM if this script dies (Linux).  A replica that exits is
reported and HAProxy routes around it: restarting it is a supervisor's job (see the doc).

Importable: :func:`render_config`, :func:`write_config`, :class:`Replicas`.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

TEMPLATE = Path(__file__).resolve().parent / "haproxy.cfg"
BACKEND = "replicas"
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # never through an env proxy

Server = Union[str, Tuple[str, int]]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def render_config(servers: Sequence[Server], listen_port: int, *, stats_port: int = 8404, host: str = "127.0.0.1",
                  template: Optional[Union[str, Path]] = None) -> str:
    """``deploy/haproxy.cfg`` (or ``template``) with its ``bind`` lines marked ``replicas.py: listen``
    / ``stats`` moved to ``host:listen_port`` / ``127.0.0.1:stats_port`` and its ``server`` lines
    replaced by one ``server rI HOST:PORT`` line per entry of ``servers``."""
    if not servers:
        raise ValueError("no servers")
    text = Path(template or TEMPLATE).read_text()
    out: List[str] = []
    found = set()
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.endswith("# replicas.py: listen"):
            found.add("listen")
            line = f"    bind {host}:{listen_port}    # replicas.py: listen"
        elif stripped.endswith("# replicas.py: stats"):
            found.add("stats")
            line = f"    bind 127.0.0.1:{stats_port}    # replicas.py: stats"
        elif stripped.startswith("server "):
            continue
        out.append(line)
        if stripped.startswith("# replicas.py: servers"):
            found.add("servers")
            for i, s in enumerate(servers, 1):
                addr = s if isinstance(s, str) else f"{s[0]}:{int(s[1])}"
                out.append(f"    server r{i} {addr}")
    missing = {"listen", "stats", "servers"} - found
    if missing:
        raise ValueError(f"template lacks the replicas.py markers: {sorted(missing)}")
    return "\n".join(out) + "\n"


def write_config(servers: Sequence[Server], listen_port: int, path: Union[str, Path], **kw) -> Path:
    """:func:`render_config` written to ``path`` (returned)."""
    path = Path(path)
    path.write_text(render_config(servers, listen_port, **kw))
    return path


def check_config(path: Union[str, Path], haproxy: str = "haproxy") -> None:
    r = subprocess.run([haproxy, "-c", "-f", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"haproxy -c -f {path} failed:\n{r.stdout}{r.stderr}")


def http_get(url: str, timeout: float = 2.0) -> Tuple[int, bytes]:
    try:
        with _OPENER.open(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _die_with_parent() -> None:   # runs in the child before exec: SIGTERM when this process dies
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except Exception:
        pass


def _spawn(cmd: List[str], log_path: Path, env=None) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True,   # Ctrl-C reaches this script only: it stops all in order
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)


def _stop(proc: Optional[subprocess.Popen], timeout: float = 30.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class Replicas:
    """``n`` replicas (``serve`` + ``serve_args``) and HAProxy in front of them; a context manager.

    After :meth:`start`: ``url`` (HAProxy), ``stats_url`` (its CSV stats), ``ports`` / ``procs`` /
    ``urls`` of the replicas (named ``r1``..``rN`` in HAProxy), ``config_path``, ``workdir`` (logs:
    ``rI.log``, ``haproxy.log``)."""

    def __init__(self, n: int, serve_args: Sequence[str] = (), *, listen_port: Optional[int] = None,
                 stats_port: Optional[int] = None, host: str = "127.0.0.1", workdir: Optional[Union[str, Path]] = None,
                 haproxy: str = "haproxy", startup_timeout: float = 300.0, env: Optional[Dict[str, str]] = None):
        if n < 1:
            raise ValueError("need at least one replica")
        self.n, self.serve_args, self.host, self.haproxy = n, list(serve_args), host, haproxy
        self.listen_port = listen_port or free_port(host)
        self.stats_port = stats_port or free_port()
        self.startup_timeout = startup_timeout
        self.env = dict(env if env is not None else os.environ, PYTHONUNBUFFERED="1")
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="dspark-replicas-"))
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{self.listen_port}"
        self.stats_url = f"http://127.0.0.1:{self.stats_port}/stats;csv"
        self.ports: List[int] = []
        self.procs: List[subprocess.Popen] = []
        self.haproxy_proc: Optional[subprocess.Popen] = None
        self.config_path = self.workdir / "haproxy.cfg"

    @property
    def names(self) -> List[str]:
        return [f"r{i}" for i in range(1, len(self.ports) + 1)]

    @property
    def urls(self) -> List[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def serve_cmd(self, port: int) -> List[str]:
        return [sys.executable, "-m", "pyllama_dspark.cli.main", "serve", *self.serve_args,
                "--host", "127.0.0.1", "--port", str(port)]

    def start(self) -> "Replicas":
        try:
            for i in range(self.n):   # all load at once; each is waited for below
                port = free_port()
                self.ports.append(port)
                self.procs.append(_spawn(self.serve_cmd(port), self.workdir / f"r{i + 1}.log", self.env))
            deadline = time.monotonic() + self.startup_timeout
            for i in range(self.n):
                self._wait(lambda i=i: self._healthy(self.urls[i] + "/health"), deadline, f"r{i + 1}",
                           self.procs[i], self.workdir / f"r{i + 1}.log")
            write_config([("127.0.0.1", p) for p in self.ports], self.listen_port, self.config_path,
                         stats_port=self.stats_port, host=self.host)
            check_config(self.config_path, self.haproxy)
            self.haproxy_proc = _spawn([self.haproxy, "-f", str(self.config_path), "-db"],
                                       self.workdir / "haproxy.log", self.env)
            self._wait(lambda: set(self.server_status().values()) == {"UP"}
                       and len(self.server_status()) == self.n, time.monotonic() + 30, "haproxy",
                       self.haproxy_proc, self.workdir / "haproxy.log")
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _healthy(url: str) -> bool:
        try:
            return http_get(url)[0] == 200
        except OSError:
            return False

    @staticmethod
    def _wait(ready, deadline: float, name: str, proc: subprocess.Popen, log: Path) -> None:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{_tail(log)}")
            try:
                if ready():
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready in time:\n{_tail(log)}")
            time.sleep(0.2)

    def server_status(self) -> Dict[str, str]:
        """HAProxy's view of each replica: ``{"r1": "UP", "r2": "DOWN", ...}`` (from its CSV stats)."""
        code, body = http_get(self.stats_url)
        if code != 200:
            raise OSError(f"stats answered {code}")
        rows = csv.DictReader(io.StringIO(body.decode().lstrip("# ")))
        return {r["svname"]: r["status"].split()[0] for r in rows
                if r["pxname"] == BACKEND and r["svname"] not in ("FRONTEND", "BACKEND")}

    def wait_status(self, name: str, status: str, timeout: float = 15.0) -> float:
        """Wait until HAProxy reports replica ``name`` as ``status``; the seconds it took."""
        t0 = time.monotonic()
        while self.server_status().get(name) != status:
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{name} not {status} after {timeout} s: {self.server_status()}")
            time.sleep(0.1)
        return time.monotonic() - t0

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to replica ``i`` (0-based; HAProxy's ``r{i+1}``) and reap it."""
        self.procs[i].send_signal(sig)
        self.procs[i].wait(timeout=30)

    def stop(self) -> None:
        """HAProxy first (no new requests reach a stopping replica), then every replica."""
        _stop(self.haproxy_proc)
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            _stop(p)

    def __enter__(self) -> "Replicas":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                 usage="%(prog)s [--replicas N] [--port P] [--stats-port P] [serve args...]")
    ap.add_argument("--replicas", type=int, default=2, help="number of serve replicas (default 2)")
    ap.add_argument("--port", type=int, default=8080, help="HAProxy's port (default 8080)")
    ap.add_argument("--listen-host", default="127.0.0.1", help="HAProxy's address (default 127.0.0.1)")
    ap.add_argument("--stats-port", type=int, default=8404, help="stats page on 127.0.0.1 (default 8404)")
    ap.add_argument("--workdir", default=None, help="config and logs (default: a new temporary directory)")
    ap.add_argument("--haproxy", default="haproxy", help="HAProxy binary")
    args, serve_args = ap.parse_known_args(argv)
    if "--host" in serve_args:
        ap.error("--host is set per replica (127.0.0.1); use --listen-host for HAProxy's address")

    def on_term(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)
    reps = Replicas(args.replicas, serve_args, listen_port=args.port, stats_port=args.stats_port,
                    host=args.listen_host, workdir=args.workdir, haproxy=args.haproxy)
    print(f"starting {args.replicas} replicas: {' '.join(reps.serve_cmd(0)[:-1])} PORT (logs: {reps.workdir})",
          flush=True)
    try:
        reps.start()
        for name, url in zip(reps.names, reps.urls):
            print(f"  {name}: {url}", flush=True)
        print(f"HAProxy: {reps.url}  (stats: http://127.0.0.1:{reps.stats_port}/stats, config: "
              f"{reps.config_path}); Ctrl-C stops everything", flush=True)
        reported = set()
        while reps.haproxy_proc.poll() is None:
            for name, p in zip(reps.names, reps.procs):
                if p.poll() is not None and name not in reported:
                    reported.add(name)
                    print(f"replica {name} exited with {p.returncode}; HAProxy routes around it "
                          f"(log: {reps.workdir / (name + '.log')})", flush=True)
            time.sleep(0.5)
        print(f"haproxy exited with {reps.haproxy_proc.returncode}:\n{_tail(reps.workdir / 'haproxy.log')}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping", flush=True)
        return 0
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        reps.stop()


if __name__ == "__main__":
    sys.exit(main())
