"""Aggregates and tables of benchmark results, laid out like the tables of the llama.cpp DSpark PR.

Per configuration and category (math, code, chat, ..., overall), as SpeedBench computes them:
``avg_pred_t_s`` = mean over requests of decode tok/s (llama-server's ``predicted_per_second``),
``avg_latency`` = mean request latency, ``accept_rate`` = accepted / drafted; plus
``tau`` = (accepted + cycles) / cycles (tokens per target verification) and the per-position
conditional acceptance (position k accepted | positions < k accepted).  A comparison row of a
speculative configuration against a baseline has ``decode_speedup`` = spec / base tok/s and
``latency_speedup`` = base / spec latency.
"""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Sequence

from tabulate import tabulate

from pyllama_dspark.measure.bench import RequestResult

CATEGORY_ORDER = ("math", "code", "chat")


def categories(results: Sequence[RequestResult]) -> List[str]:
    seen = list(dict.fromkeys(r.category for r in results))
    return [c for c in CATEGORY_ORDER if c in seen] + [c for c in seen if c not in CATEGORY_ORDER]


def summarize(results: Sequence[RequestResult]) -> dict:
    """Aggregate of one group of requests (one configuration, one category)."""
    if not results:
        return {"requests": 0}
    drafted = sum(r.drafted for r in results)
    accepted = sum(r.accepted for r in results)
    cycles = sum(r.cycles for r in results)
    width = max((len(r.pos_drafted) for r in results), default=0)
    pd = [sum(r.pos_drafted[k] for r in results if k < len(r.pos_drafted)) for k in range(width)]
    pa = [sum(r.pos_accepted[k] for r in results if k < len(r.pos_accepted)) for k in range(width)]
    return {
        "requests": len(results),
        "turns": sum(r.turns for r in results),
        "n_generated": sum(r.n_generated for r in results),
        "avg_pred_t_s": statistics.mean(r.decode_tps for r in results),
        "avg_latency": statistics.mean(r.latency_s for r in results),
        "draft_n": drafted,
        "accepted": accepted,
        "accept_rate": accepted / drafted if drafted else None,
        "tau": (accepted + cycles) / cycles if cycles else None,
        "accept_per_position": [a / d if d else None for a, d in zip(pa, pd)],
        "pos_drafted": pd,
    }


def summary_table(results: Sequence[RequestResult]) -> Dict[str, Dict[str, dict]]:
    """{config: {category | "overall": aggregate}}."""
    out: Dict[str, Dict[str, dict]] = {}
    for cfg in dict.fromkeys(r.config for r in results):
        rs = [r for r in results if r.config == cfg]
        out[cfg] = {c: summarize([r for r in rs if r.category == c]) for c in categories(rs)}
        out[cfg]["overall"] = summarize(rs)
    return out


def compare(summary: Dict[str, Dict[str, dict]], base: str, spec: str) -> List[dict]:
    rows = []
    for cat, s in summary.get(spec, {}).items():
        b = summary.get(base, {}).get(cat)
        if not b or not b.get("requests") or not s.get("requests"):
            continue
        rows.append({
            "category": cat,
            "base_avg_pred_t_s": b["avg_pred_t_s"], "spec_avg_pred_t_s": s["avg_pred_t_s"],
            "decode_speedup": s["avg_pred_t_s"] / b["avg_pred_t_s"] if b["avg_pred_t_s"] else None,
            "base_avg_latency": b["avg_latency"], "spec_avg_latency": s["avg_latency"],
            "latency_speedup": b["avg_latency"] / s["avg_latency"] if s["avg_latency"] else None,
            "accept_rate": s["accept_rate"], "tau": s["tau"],
        })
    return rows


def _f(v, kind: str) -> str:
    if v is None:
        return "n/a"
    return {"speed": f"{v:.2f}", "x": f"{v:.2f}x", "s": f"{v:.3f}s", "rate": f"{v:.4f}", "tau": f"{v:.3f}"}[kind]


def comparison_text(rows: List[dict], base: str, spec: str) -> str:
    b, s = ("base", "spec") if base == "none" else (base, spec)
    headers = ["category", f"{b}_avg_pred_t/s", f"{s}_avg_pred_t/s", "decode_speedup", f"{b}_avg_latency",
               f"{s}_avg_latency", "latency_speedup", "accept_rate", "tau"]
    body = [[r["category"], _f(r["base_avg_pred_t_s"], "speed"), _f(r["spec_avg_pred_t_s"], "speed"),
             _f(r["decode_speedup"], "x"), _f(r["base_avg_latency"], "s"), _f(r["spec_avg_latency"], "s"),
             _f(r["latency_speedup"], "x"), _f(r["accept_rate"], "rate"), _f(r["tau"], "tau")] for r in rows]
    return tabulate(body, headers=headers, tablefmt="simple", disable_numparse=True)


def position_text(summary: Dict[str, Dict[str, dict]]) -> str:
    """Per-position conditional acceptance, one row per configuration and category (+ overall)."""
    width = max((len(c.get("accept_per_position") or []) for s in summary.values() for c in s.values()),
                default=0)
    if width == 0:
        return ""
    rows = []
    for cfg, s in summary.items():
        for cat, agg in s.items():
            per = agg.get("accept_per_position") or []
            if not per:
                continue
            rows.append([cfg, cat] + [("n/a" if x is None else f"{x:.3f}") for x in per] + [""] * (width - len(per)))
    return tabulate(rows, headers=["config", "category"] + [f"pos{k + 1}" for k in range(width)],
                    tablefmt="simple", disable_numparse=True)


def lossless_mismatches(results: Sequence[RequestResult]) -> List[str]:
    """Prompts where greedy configurations emitted different tokens (should be none at T = 0)."""
    by_prompt: Dict[tuple, Dict[str, List[int]]] = {}
    for r in results:
        by_prompt.setdefault((r.source, r.index), {})[r.config] = r.tokens
    out = []
    for (src, idx), toks in by_prompt.items():
        vals = list(toks.values())
        if any(v != vals[0] for v in vals[1:]):
            out.append(f"{src}#{idx}")
    return out


def report_text(results: Sequence[RequestResult], greedy: bool = True) -> str:
    summary = summary_table(results)
    cfgs = list(summary)
    parts = []
    for spec in [c for c in cfgs if c != "none"]:
        if "none" in cfgs:
            parts.append(f"{spec} vs baseline (no draft):\n" + comparison_text(compare(summary, "none", spec), "none", spec))
    ds = _fixed_dspark(cfgs)
    if "dflash" in cfgs and ds:
        parts.append(f"{ds} vs dflash (same draft, Markov head off):\n"
                     + comparison_text(compare(summary, "dflash", ds), "dflash", ds))
    if len(cfgs) == 1 or "none" not in cfgs:
        rows = [[cfg, cat, s["requests"], _f(s["avg_pred_t_s"], "speed"), _f(s["avg_latency"], "s"),
                 _f(s["accept_rate"], "rate"), _f(s["tau"], "tau")]
                for cfg, cats in summary.items() for cat, s in cats.items()]
        parts.append(tabulate(rows, headers=["config", "category", "samples", "avg_pred_t/s", "avg_latency",
                                             "accept_rate", "tau"], tablefmt="simple", disable_numparse=True))
    pos = position_text(summary)
    if pos:
        parts.append("per-position conditional acceptance:\n" + pos)
    if greedy:
        bad = lossless_mismatches(results)
        if bad:
            parts.append(f"WARNING: greedy outputs differ between configurations on {len(bad)} prompt(s): "
                         + ", ".join(bad[:10]) + " (run `pyllama-dspark crosscheck` on them)")
    return "\n\n".join(parts)


def report_json(results: Sequence[RequestResult], config: Optional[dict] = None) -> dict:
    summary = summary_table(results)
    cfgs = list(summary)
    comps = {}
    for spec in [c for c in cfgs if c != "none"]:
        if "none" in cfgs:
            comps[f"{spec}_vs_none"] = compare(summary, "none", spec)
    ds = _fixed_dspark(cfgs)
    if "dflash" in cfgs and ds:
        comps["dspark_vs_dflash"] = compare(summary, "dflash", ds)
    return {"config": config or {}, "summary": summary, "comparisons": comps,
            "greedy_mismatches": lossless_mismatches(results), "results": [r.as_dict() for r in results]}


def plot_positions(results: Sequence[RequestResult], path: str, title: str = "") -> str:
    """PNG of the per-position conditional acceptance of each speculative configuration: one panel per
    category and one for all requests."""
    try:
        import matplotlib
    except ImportError as e:  # optional dependency
        raise RuntimeError("the plot needs matplotlib: pip install 'pyllama-dspark[plot]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    summary = summary_table(results)
    cats = [c for c in next(iter(summary.values()), {}) if c != "overall"] + ["overall"] if summary else []
    fig, axes = plt.subplots(1, max(1, len(cats)), figsize=(3.2 * max(1, len(cats)), 3.6), dpi=100,
                             sharey=True, squeeze=False)
    for ax, cat in zip(axes[0], cats):
        n_lines = 0
        for cfg, s in summary.items():
            per = (s.get(cat) or {}).get("accept_per_position") or []
            xs = [k + 1 for k, v in enumerate(per) if v is not None]
            ys = [v for v in per if v is not None]
            if xs:
                ax.plot(xs, ys, marker="o", label=cfg)
                n_lines += 1
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("block position k")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(cat)
        ax.grid(True, alpha=0.3)
        if n_lines:
            ax.legend(fontsize=8)
    axes[0][0].set_ylabel("P(accept k | accepted < k)")
    fig.suptitle(title or "per-position conditional acceptance")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _fixed_dspark(cfgs) -> str:
    """The DSpark configuration to compare with DFlash mode (both verifying every draft), if any."""
    return "dspark-fixed" if "dspark-fixed" in cfgs else "dspark" if "dspark" in cfgs else ""
