"""llama-server's ``GET /metrics`` (``serve --metrics``): Prometheus text made by ``prometheus_client``.

The names, help texts and kinds are llama-server's (tools/server/server-task.cpp ``to_metrics``):

* counters ``llamacpp:prompt_tokens_total`` (prompt tokens processed, cached ones excluded),
  ``prompt_tokens_cached_total``, ``prompt_seconds_total``, ``tokens_predicted_total``,
  ``tokens_predicted_seconds_total``, ``n_decode_total`` (target ``llama_decode`` calls since the
  server started; draft decodes excluded, as llama-server excludes them),
  ``spec_decode_num_draft_tokens_total``, ``spec_decode_num_accepted_tokens_total``,
  ``spec_decode_num_drafts_total`` (verification steps with a non-empty draft) and, per draft
  position, ``spec_decode_num_accepted_tokens_per_pos_total{position="i"}``;
* ``llamacpp:n_tokens_max`` (largest prompt + generation seen): llama-server declares it a counter,
  but ``prometheus_client`` names every counter's HELP / TYPE lines ``<name>_total``, so to keep the
  exact name it is exposed as a gauge (what a maximum is);
* gauges ``prompt_tokens_seconds`` and ``predicted_tokens_seconds`` (throughput over the window
  since the previous scrape: each scrape starts a new window, as in llama-server; generation steps
  exclude each request's first token), ``requests_processing``, ``requests_deferred`` (queued for a
  slot), ``n_busy_slots_per_decode`` (the decodes each request took part in -- its prompt chunks and
  its cycles -- over the target decodes: 1 with a context per slot, more when slots share decodes);
* ours beside them: ``llamacpp:dspark_verify_rows_total`` (target rows verified: per cycle the anchor
  plus the drafts verified) and ``llamacpp:dspark_cycles_drafted_total`` (cycles that verified a
  drafted block); with the RAM prompt cache (``--cache-ram``), ``llamacpp:dspark_prompt_cache_hits_total``
  / ``_misses_total`` (a slot's state exchange found a kept state that serves the prompt better, or
  none), gauges ``llamacpp:dspark_prompt_cache_bytes`` / ``_states`` / ``_limit_bytes``.

Everything is updated from each finished request's ``Done.stats`` (:meth:`ServerMetrics.observe`,
thread-safe); ``prometheus_client`` is imported only when the text is rendered.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, List, Tuple

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
NOT_ENABLED = "This server does not support metrics endpoint. Start it with `--metrics`"

_COUNTERS = [
    ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", "prompt_tokens"),
    ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", "prompt_cached"),
    ("prompt_seconds_total", "Total time spent processing prompts", "prompt_seconds"),
    ("tokens_predicted_total", "Number of generation tokens processed", "predicted"),
    ("tokens_predicted_seconds_total", "Total time spent generating tokens", "predicted_seconds"),
    ("n_decode_total", "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding",
     "n_decode"),
    ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", "draft_tokens"),
    ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model",
     "draft_accepted"),
    ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps", "verif_steps"),
]
_DSPARK_COUNTERS = [
    ("dspark_verify_rows_total", "DSpark: Total target rows verified (per cycle: the anchor plus the drafts verified)",
     "verify_rows"),
    ("dspark_cycles_drafted_total", "DSpark: Total cycles that verified a drafted block", "cycles_drafted"),
]


def _targets(pool: Any) -> List[Any]:
    sps = getattr(pool, "speculators", None)
    if not sps:
        try:
            sps = [pool.front]
        except Exception:   # no engine behind it (tests)
            return []
    return [getattr(sp, "target", None) for sp in sps]


class ServerMetrics:
    """Totals over the finished requests of one server, and their Prometheus text."""

    def __init__(self, pool: Any):
        self.pool = pool
        self.t_start = int(time.time())
        self._lock = threading.Lock()
        self.totals = {key: 0.0 for _, _, key in _COUNTERS + _DSPARK_COUNTERS}
        self.n_tokens_max = 0
        self.busy_decodes = 0            # sum over requests of the target decodes each took part in
        self.pos_accepted: List[int] = []
        # the throughput windows (reset by each scrape): (tokens or steps, seconds)
        self._win_prompt = [0, 0.0]
        self._win_predict = [0, 0.0]
        self._decodes0 = self._target_decodes()

    def _target_decodes(self) -> int:
        return sum(int(getattr(t, "n_decodes", 0) or 0) for t in _targets(self.pool))

    def _n_batch(self) -> int:
        ts = _targets(self.pool)
        return max(1, int(getattr(ts[0], "n_batch", 512) or 512)) if ts else 512

    def observe(self, stats: Any) -> None:
        """Count one finished request (its engine ``Stats``)."""
        n_prompt, n_cached = int(stats.n_prompt), int(getattr(stats, "n_cached", 0) or 0)
        n_proc, n_gen = max(0, n_prompt - n_cached), int(stats.n_generated)
        s_prompt, s_gen = float(stats.ms_prefill) / 1e3, float(stats.ms_total) / 1e3
        vl = list(getattr(stats, "verify_lengths", ()) or ())
        pos = list(getattr(stats, "pos_accepted", ()) or ())
        cycles = int(getattr(stats, "cycles", 0) or 0)
        prefill_decodes = math.ceil(n_proc / self._n_batch())
        with self._lock:
            t = self.totals
            t["prompt_tokens"] += n_proc
            t["prompt_cached"] += n_cached
            t["prompt_seconds"] += s_prompt
            t["predicted"] += n_gen
            t["predicted_seconds"] += s_gen
            t["draft_tokens"] += int(stats.drafted)
            t["draft_accepted"] += int(stats.accepted)
            drafted_cycles = sum(1 for d in vl if d > 0)
            t["verif_steps"] += drafted_cycles
            t["cycles_drafted"] += drafted_cycles
            t["verify_rows"] += sum(1 + int(d) for d in vl)
            self.n_tokens_max = max(self.n_tokens_max, n_prompt + n_gen)
            self.busy_decodes += prefill_decodes + cycles
            if len(self.pos_accepted) < len(pos):
                self.pos_accepted += [0] * (len(pos) - len(self.pos_accepted))
            for i, a in enumerate(pos):
                self.pos_accepted[i] += int(a)
            self._win_prompt[0] += n_proc
            self._win_prompt[1] += s_prompt
            self._win_predict[0] += max(0, n_gen - 1)   # decode steps: the first token came with the prompt
            self._win_predict[1] += s_gen

    def _snapshot(self) -> Tuple[dict, dict, List[int]]:
        with self._lock:
            counters = dict(self.totals)
            n_decode = max(0, self._target_decodes() - self._decodes0)
            counters["n_decode"] = n_decode
            (pn, ps), (gn, gs) = self._win_prompt, self._win_predict
            self._win_prompt, self._win_predict = [0, 0.0], [0, 0.0]
            gauges = {
                "prompt_tokens_seconds": pn / ps if ps > 0 else 0.0,
                "predicted_tokens_seconds": gn / gs if gs > 0 else 0.0,
                "requests_processing": _int_attr(self.pool, "n_busy"),
                "requests_deferred": _int_attr(self.pool, "n_queued"),
                "n_busy_slots_per_decode": self.busy_decodes / max(n_decode, 1),
                "n_tokens_max": self.n_tokens_max,
            }
            return counters, gauges, list(self.pos_accepted)

    def render(self) -> bytes:
        """The Prometheus text of the current totals; starts a new throughput window."""
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        counters, gauges, pos = self._snapshot()
        info = getattr(self.pool, "store_info", None)
        store = info() if callable(info) else None

        class _Collector:
            def collect(self):
                for name, doc, key in _COUNTERS:
                    yield CounterMetricFamily("llamacpp:" + name, doc, value=counters[key])
                yield GaugeMetricFamily("llamacpp:n_tokens_max",
                                        "Largest observed sequence length (prompt + generation)",
                                        value=gauges["n_tokens_max"])
                for name, doc in _GAUGES:
                    yield GaugeMetricFamily("llamacpp:" + name, doc, value=gauges[name])
                if pos:
                    fam = CounterMetricFamily("llamacpp:spec_decode_num_accepted_tokens_per_pos_total",
                                              "Accepted tokens per draft position", labels=["position"])
                    for i, a in enumerate(pos):
                        fam.add_metric([str(i)], a)
                    yield fam
                for name, doc, key in _DSPARK_COUNTERS:
                    yield CounterMetricFamily("llamacpp:" + name, doc, value=counters[key])
                if store is not None:
                    for key in ("hits", "misses"):
                        yield CounterMetricFamily(f"llamacpp:dspark_prompt_cache_{key}_total",
                                                  f"DSpark: RAM prompt cache {key}", value=store[key])
                    for key in ("bytes", "states", "limit_bytes"):
                        yield GaugeMetricFamily(f"llamacpp:dspark_prompt_cache_{key}",
                                                f"DSpark: RAM prompt cache {key.replace('_', ' ')}", value=store[key])

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector())
        return generate_latest(registry)


_GAUGES = [
    ("prompt_tokens_seconds", "Average prompt throughput in tokens/s"),
    ("predicted_tokens_seconds", "Average generation throughput in tokens/s"),
    ("requests_processing", "Number of requests processing"),
    ("requests_deferred", "Number of requests deferred"),
    ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call"),
]


def _int_attr(obj: Any, name: str) -> int:
    try:
        return int(getattr(obj, name, 0) or 0)
    except Exception:   # a pool that is closing
        return 0


__all__ = ["CONTENT_TYPE", "NOT_ENABLED", "ServerMetrics"]
