"""The servers the agents'-API tests share (``test_anthropic.py``, ``test_responses.py``): for the real
SmolLM2 target (``smol``, with the shipped drafter) and random targets carrying Qwen3's and Llama
3.2's templates (``qwen``, ``llama3``, with a random draft), llama-server ``--jinja`` (``-cpp``), ``serve`` without a draft
(``-plain``) and with one (``-draft``, schedule off: every block verified), each started on first use."""

from __future__ import annotations

from pathlib import Path

import tool_targets as tt
from greedy_ref import TEST_THREADS
from serve_helpers import SESSION, ServeProcess


class Servers:
    def __init__(self, target_path: str, d: Path):
        from pyllama_dspark.gguf.testing import make_test_draft
        from pyllama_dspark.paths import default_draft

        self.d = d
        self.files = {"smol": (target_path, default_draft())}
        for name, kind in (("qwen", "qwen3"), ("llama3", "llama3")):
            t = tt.build(kind, d)
            self.files[name] = (t, make_test_draft(t, str(d / f"draft-{name}.gguf"), kind="dspark", seed=3))
        self.up: dict = {}

    def __call__(self, which: str):
        """``"smol-cpp"``, ``"qwen-draft"``, ...: the server, started once."""
        from pyllama_dspark.upstream.llama_server import LlamaServer
        from pyllama_dspark.upstream.llama_server_build import ensure_llama_server

        if which not in self.up:
            model, kind = which.split("-")
            target, draft = self.files[model]
            if kind == "cpp":
                self.up[which] = LlamaServer(ensure_llama_server(), target, None, ctx=4096, threads=TEST_THREADS,
                                             extra_args=["--jinja"], trace=False,
                                             log_path=self.d / f"{which}.log").start()
            else:
                self.up[which] = ServeProcess(target, draft if kind == "draft" else None, self.d / f"{which}.log",
                                              n_ctx=4096, extra=["--schedule", "off"] if kind == "draft" else [])
        return self.up[which]

    def stop(self) -> None:
        for s in self.up.values():
            s.stop()


def url(srv) -> str:
    return srv.base_url if hasattr(srv, "base_url") else srv.url


def post(srv, path: str, body: dict):
    return SESSION.post(url(srv) + path, json=body, timeout=600)
