"""llama.cpp's own ``llama-server`` as a reference DSpark driver (tests, ``crosscheck``).

:class:`LlamaServer` runs the binary that :func:`~.llama_server_build.ensure_llama_server` builds on
127.0.0.1 (optionally with a DSpark/DFlash draft), sends token-id prompts to ``POST /completion``
and returns the generated token ids, the server's timings (``draft_n`` / ``draft_n_accepted``) and
the per-verification-step draft counts parsed from the server log (:mod:`.llama_server_log`).

Only the standard library is used (``urllib`` for HTTP, ``subprocess`` for the server).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from pyllama_dspark.llama.amx import cpu_has_amx
from pyllama_dspark.errors import DSparkError
from pyllama_dspark.upstream.llama_server_log import parse_draft_acceptance, parse_spec_steps
from pyllama_dspark.upstream.llama_server_sdist import PathLike


class LlamaServerError(DSparkError, RuntimeError):
    """llama-server failed to start, died, or answered with an error."""


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """A ``llama-server`` child process on 127.0.0.1, one slot, greedy by default.

    >>> with LlamaServer(ensure_llama_server(), target, draft) as srv:
    ...     out = srv.complete(prompt_tokens, 64)
    ...     out["tokens"], out["timings"]["draft_n"], out["steps"]

    Command line (all flags checked against common/arg.cpp of this commit)::

        llama-server -m MODEL --host 127.0.0.1 --port P -c CTX -np 1 -fa FA
                     --temp 0 --top-k 1 --seed SEED --no-webui -cram 0
                     [-t T -tb T] [-b B] [-ub UB]
                     [-md DRAFT --spec-type TYPE --spec-draft-n-max N [--spec-draft-p-min P]]
                     EXTRA_ARGS...

    ``LLAMA_TRACE=1`` is set in its environment (``trace=True``) so every verification step is
    logged; the log (stdout + stderr) goes to ``log_path`` or a temporary file.
    """

    def __init__(self, binary: PathLike, model: PathLike, draft: Optional[PathLike] = None, *,
                 spec_type: str = "draft-dspark", n_max: int = 7, p_min: Optional[float] = None,
                 ctx: int = 4096, threads: Optional[int] = None, extra_args: Iterable[str] = (),
                 port: Optional[int] = None, log_path: Optional[PathLike] = None,
                 env: Optional[Mapping[str, str]] = None, flash_attn: str = "auto",
                 n_batch: Optional[int] = None, n_ubatch: Optional[int] = None, seed: int = 0,
                 trace: bool = True, startup_timeout: float = 300.0,
                 request_timeout: float = 600.0) -> None:
        self.binary = Path(binary)
        self.model = Path(model)
        self.draft = Path(draft) if draft is not None else None
        if not self.binary.is_file():
            raise LlamaServerError(f"llama-server binary not found: {self.binary}")
        if not self.model.is_file():
            raise LlamaServerError(f"model not found: {self.model}")
        if self.draft is not None and not self.draft.is_file():
            raise LlamaServerError(f"draft model not found: {self.draft}")
        if flash_attn not in ("on", "off", "auto"):
            raise ValueError(f"flash_attn must be 'on', 'off' or 'auto', not {flash_attn!r}")
        if int(n_max) < 0:
            raise ValueError("n_max must be >= 0")
        self.spec_type = spec_type
        self.n_max = int(n_max)
        self.p_min = p_min
        self.ctx = int(ctx)
        self.threads = threads
        self.extra_args = [str(a) for a in extra_args]
        self.port = port
        self.flash_attn = flash_attn
        self.n_batch = n_batch
        self.n_ubatch = n_ubatch
        self.seed = int(seed)
        self.trace = trace
        self.startup_timeout = float(startup_timeout)
        self.request_timeout = float(request_timeout)
        self._env_extra = dict(env or {})
        self._log_path_arg = Path(log_path) if log_path is not None else None
        self.log_path: Optional[Path] = None
        self._tmpdir: Optional[tempfile.TemporaryDirectory] = None
        self._proc: Optional[subprocess.Popen] = None
        self._logf = None
        # never route 127.0.0.1 through an http_proxy from the environment
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> List[str]:
        """The argv used to start the server (port must be set)."""
        cmd = [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
               "-c", str(self.ctx), "-np", "1", "-fa", self.flash_attn,
               "--temp", "0", "--top-k", "1", "--seed", str(self.seed),
               "--no-webui", "-cram", "0"]
        if cpu_has_amx():
            # the same model loading as ours: llama.cpp's AMX repacking crashes with a draft's
            # capture on, and repacked weights would change the numerics (see pyllama_dspark.llama.amx)
            cmd += ["--no-repack"]
        if self.threads is not None:
            cmd += ["-t", str(int(self.threads)), "-tb", str(int(self.threads))]
        if self.n_batch is not None:
            cmd += ["-b", str(int(self.n_batch))]
        if self.n_ubatch is not None:
            cmd += ["-ub", str(int(self.n_ubatch))]
        if self.draft is not None:
            cmd += ["-md", str(self.draft), "--spec-type", self.spec_type, "--spec-draft-n-max", str(self.n_max)]
            if self.p_min is not None:
                cmd += ["--spec-draft-p-min", repr(float(self.p_min))]
        cmd += self.extra_args
        return cmd

    def start(self) -> "LlamaServer":
        if self.running:
            return self
        if self._log_path_arg is not None:
            self.log_path = self._log_path_arg
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        else:
            self._tmpdir = tempfile.TemporaryDirectory(prefix="llama-server-")
            self.log_path = Path(self._tmpdir.name) / "llama-server.log"
        env = dict(os.environ)
        if self.trace:
            env["LLAMA_TRACE"] = "1"
        env.update(self._env_extra)
        attempts = 1 if self.port is not None else 3
        fixed_port = self.port
        last_err: Optional[Exception] = None
        for _ in range(attempts):
            self.port = fixed_port if fixed_port is not None else _free_port()
            self._logf = open(self.log_path, "ab")
            cmd = self.command()
            self._logf.write(("$ " + " ".join(cmd) + "\n").encode())
            self._logf.flush()
            self._proc = subprocess.Popen(cmd, stdout=self._logf, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, start_new_session=True)
            try:
                self._wait_ready()
                return self
            except LlamaServerError as exc:
                last_err = exc
                self._shutdown()
                if "bind" not in str(exc).lower() and "address already in use" not in str(exc).lower():
                    break
        assert last_err is not None
        raise last_err

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            rc = self._proc.poll() if self._proc else -1
            if rc is not None:
                raise LlamaServerError(
                    f"llama-server exited with code {rc} during startup; log {self.log_path}:\n{self.log_tail()}")
            try:
                with self._opener.open(self.base_url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except urllib.error.HTTPError as exc:  # 503 while the model is loading
                if exc.code != 503:
                    raise LlamaServerError(f"/health answered {exc.code}: {exc.read()[:500]!r}") from exc
            except (urllib.error.URLError, ConnectionError, socket.timeout, OSError):
                pass
            time.sleep(0.2)
        raise LlamaServerError(
            f"llama-server not ready after {self.startup_timeout:.0f} s; log {self.log_path}:\n{self.log_tail()}")

    def _shutdown(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        if self._logf is not None:
            self._logf.close()
            self._logf = None

    def stop(self) -> None:
        """Terminate (then kill) the server. The log file is kept when ``log_path`` was given."""
        self._shutdown()
        if self._tmpdir is not None:
            self._keep_log_text = self.log_text()
            self._tmpdir.cleanup()
            self._tmpdir = None

    close = stop

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self._shutdown()
        except Exception:
            pass

    # -- log ---------------------------------------------------------------------------------

    def log_text(self, offset: int = 0) -> str:
        if self.log_path is None or not self.log_path.exists():
            return getattr(self, "_keep_log_text", "")[offset:]
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", errors="replace")

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size if self.log_path else 0
        except OSError:
            return 0

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    # -- HTTP --------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: Optional[dict] = None, timeout: Optional[float] = None) -> Any:
        if not self.running:
            raise LlamaServerError(f"llama-server is not running; log {self.log_path}:\n{self.log_tail()}")
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with self._opener.open(req, timeout=timeout or self.request_timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", errors="replace")[:2000]
            raise LlamaServerError(f"{method} {path} -> HTTP {exc.code}: {detail}") from exc
        except (urllib.error.URLError, ConnectionError, socket.timeout) as exc:
            raise LlamaServerError(f"{method} {path} failed: {exc}; log tail:\n{self.log_tail()}") from exc
        return json.loads(raw) if raw else None

    def health(self) -> dict:
        return self._request("GET", "/health")

    def props(self) -> dict:
        return self._request("GET", "/props")

    def complete(self, prompt_tokens: Sequence[int], n_predict: int, **sampling: Any) -> Dict[str, Any]:
        """Greedy completion of a token-id prompt through ``POST /completion``.

        The prompt is sent as a JSON array of ints: llama-server then uses it verbatim (no BOS is
        added, no re-tokenization: tools/server/server-common.cpp ``tokenize_input_subprompt``).
        ``cache_prompt`` is off (the whole prompt is evaluated, like a fresh context),
        ``return_tokens`` on. Generation stops at any end-of-generation token (``ignore_eos``
        defaults to false; the EOG token is the last element of ``tokens``) or after
        ``n_predict`` tokens. ``sampling`` entries override/extend the request body
        (``temperature`` 0 and ``top_k`` 1 by default).

        Returns ``{"tokens", "content", "timings", "stop_type", "stopping_word", "truncated",
        "steps", "acceptance", "log", "raw"}``; ``steps`` is the list of per-verification
        (n_drafted, n_accepted) from the log (needs ``trace=True``).
        """
        toks = [int(t) for t in prompt_tokens]
        if not toks:
            raise ValueError("prompt_tokens must not be empty")
        if any(t < 0 for t in toks):
            raise ValueError("prompt_tokens must be non-negative token ids")
        if int(n_predict) < 0 and int(n_predict) != -1:
            raise ValueError("n_predict must be >= 0 (or -1 for no limit)")
        body: Dict[str, Any] = {
            "prompt": toks,
            "n_predict": int(n_predict),
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
            "temperature": 0.0,
            "top_k": 1,
            "seed": self.seed,
        }
        body.update(sampling)
        offset = self._log_size()
        raw = self._request("POST", "/completion", body)
        log = self._wait_for_log(offset)
        tasks = [int(t) for t in re.findall(r"\| task (-?\d+) \|", log)]
        task = tasks[-1] if tasks else None
        return {
            "tokens": list(raw.get("tokens") or []),
            "content": raw.get("content", ""),
            "timings": raw.get("timings", {}),
            "stop_type": raw.get("stop_type"),
            "stopping_word": raw.get("stopping_word"),
            "truncated": raw.get("truncated"),
            "tokens_predicted": raw.get("tokens_predicted"),
            "tokens_evaluated": raw.get("tokens_evaluated"),
            "steps": parse_spec_steps(log, task),
            "acceptance": parse_draft_acceptance(log, task),
            "task": task,
            "log": log,
            "raw": raw,
        }

    def _wait_for_log(self, offset: int, timeout: float = 10.0) -> str:
        """Log written since ``offset``, once the slot has been released (logged after the reply)."""
        deadline = time.monotonic() + timeout
        text = self.log_text(offset)
        while "stop processing" not in text and time.monotonic() < deadline and self.running:
            time.sleep(0.05)
            text = self.log_text(offset)
        return text
