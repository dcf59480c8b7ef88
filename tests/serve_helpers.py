"""A ``pyllama-dspark serve`` child process on 127.0.0.1 for tests (always stopped), SSE parsing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

import requests

SESSION = requests.Session()
SESSION.trust_env = False  # never route 127.0.0.1 through a proxy from the environment


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    def __init__(self, target: str, draft: Optional[str], log_path: Path, *, n_slots: int = 1, n_ctx: int = 1024,
                 extra: Sequence[str] = (), startup_timeout: float = 180.0, env: Optional[dict] = None):
        self.extra = list(extra)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pyllama_dspark.cli.main", "serve", "-m", target, "--host", "127.0.0.1",
               "--port", str(self.port), "-np", str(n_slots), "-t", "1", "-c", str(n_ctx * n_slots), "--temp", "0"]
        if draft is not None:
            cmd += ["-md", draft]
        cmd += list(extra)
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")
        env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=str(Path(__file__).resolve().parent.parent))
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"serve exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
            try:
                if SESSION.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"serve not ready after {startup_timeout} s:\n{self.log_text()[-3000:]}")
            time.sleep(0.2)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        if not self._log.closed:
            self._log.close()

    def post(self, path: str, body, **kw) -> requests.Response:
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
        return SESSION.post(self.url + path, data=data, headers=headers, timeout=kw.pop("timeout", 300), **kw)

    def get(self, path: str, **kw) -> requests.Response:
        return SESSION.get(self.url + path, timeout=kw.pop("timeout", 30), **kw)


def sse_events(resp: requests.Response) -> Iterator[str]:
    """The ``data:`` payloads of a server-sent event stream, in order (``[DONE]`` included)."""
    for line in resp.iter_lines(decode_unicode=True):
        if line and line.startswith("data:"):
            yield line[len("data:"):].strip()


def sse_json(resp: requests.Response) -> List:
    out = []
    for d in sse_events(resp):
        out.append(d if d == "[DONE]" else json.loads(d))
    return out
