"""llama-server's per-request ``timings`` object and its draft-acceptance log lines, from Stats.

llama-server (tools/server/server-common.cpp ``server_slot_stats::to_json``) reports::

    cache_n                              (prompt tokens reused from the slot's cache)
    prompt_n, prompt_ms, prompt_per_token_ms, prompt_per_second,
    predicted_n, predicted_ms, predicted_per_token_ms, predicted_per_second,
    draft_n, draft_n_accepted            (llama-server: only when something was drafted)

and logs, per finished request (``print_timings``)::

    slot print_timings: id  0 | task 3 | prompt eval time = ... ms / N tokens (...)
    slot print_timings: id  0 | task 3 |        eval time = ... ms / N tokens (...)
    slot print_timings: id  0 | task 3 | draft acceptance = 0.12500 (    1 accepted /     8 generated), mean len =  1.12

Here ``draft_n`` / ``draft_n_accepted`` are always present (0 without a draft), so clients such as
llama.cpp's SpeedBench read the same numbers either way.
"""

from __future__ import annotations

from typing import Any, Dict, List


def _rate(n: int, ms: float) -> float:
    return 1e3 * n / ms if ms > 0 else 0.0


def _per_token(n: int, ms: float) -> float:
    return ms / n if n > 0 else 0.0


def llama_timings(stats: Any) -> Dict[str, Any]:
    """The ``timings`` dict of one request from an engine ``Stats`` (prefill / generation split)."""
    cn = int(getattr(stats, "n_cached", 0))
    pn, pms = int(stats.n_prompt) - cn, float(stats.ms_prefill)
    gn, gms = int(stats.n_generated), float(stats.ms_total)
    return {
        "cache_n": cn,
        "prompt_n": pn,
        "prompt_ms": pms,
        "prompt_per_token_ms": _per_token(pn, pms),
        "prompt_per_second": _rate(pn, pms),
        "predicted_n": gn,
        "predicted_ms": gms,
        "predicted_per_token_ms": _per_token(gn, gms),
        "predicted_per_second": _rate(gn, gms),
        "draft_n": int(stats.drafted),
        "draft_n_accepted": int(stats.accepted),
    }


def timing_log_lines(slot: int, task: int, stats: Any) -> List[str]:
    """llama-server's ``print_timings`` lines for one finished request (same wording and layout,
    so the parser in :mod:`pyllama_dspark.upstream.llama_server_log` reads our log as it reads llama-server's)."""
    t = llama_timings(stats)
    head = f"slot print_timings: id {slot:2d} | task {task} | "
    lines = [
        head + (f"prompt eval time = {t['prompt_ms']:10.2f} ms / {t['prompt_n']:5d} tokens "
                f"({t['prompt_per_token_ms']:8.2f} ms per token, {t['prompt_per_second']:8.2f} tokens per second)"),
        head + (f"       eval time = {t['predicted_ms']:10.2f} ms / {t['predicted_n']:5d} tokens "
                f"({t['predicted_per_token_ms']:8.2f} ms per token, {t['predicted_per_second']:8.2f} tokens per second)"),
        head + (f"      total time = {t['prompt_ms'] + t['predicted_ms']:10.2f} ms / "
                f"{t['prompt_n'] + t['predicted_n']:5d} tokens"),
    ]
    if t["draft_n"] > 0:
        ratio = t["draft_n_accepted"] / t["draft_n"]
        steps = max(1, sum(1 for d in getattr(stats, "verify_lengths", []) if d > 0))
        mean_len = 1.0 + t["draft_n_accepted"] / steps
        lines.append(head + (f"draft acceptance = {ratio:0.5f} ({t['draft_n_accepted']:5d} accepted / "
                             f"{t['draft_n']:5d} generated), mean len = {mean_len:5.2f}"))
        per = getattr(stats, "accept_per_position", None)
        if per:
            lines.append(head + "cond. acc per pos = (" + ", ".join(f"{x:.3f}" for x in per) + ")")
    return lines
