"""``pyllama-dspark convert`` (HF drafter checkpoint -> draft GGUF) and ``export`` (the inverse)."""

from __future__ import annotations

import click

from pyllama_dspark.errors import DSparkError


@click.command("convert")
@click.argument("checkpoint_dir", type=click.Path(file_okay=False))
@click.option("--target", "target", required=True, type=click.Path(dir_okay=False),
              help="Target GGUF the draft is for (vocabulary, tokenizer and RoPE facts come from it).")
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False), help="Draft GGUF to write.")
@click.option("--outtype", type=click.Choice(["auto", "f32", "f16", "bf16", "q8_0"]), default="auto", show_default=True,
              help="Type of the weight matrices (auto: keep each tensor's checkpoint type). Norms, biases and "
                   "fc.weight stay F32.")
def convert_cmd(checkpoint_dir, target, output, outtype):
    """Convert a released DSpark/DFlash drafter checkpoint (safetensors + config.json) to a draft GGUF."""
    from pyllama_dspark.interop.convert import convert_checkpoint

    try:
        path = convert_checkpoint(checkpoint_dir, target, output, outtype=outtype)
    except (DSparkError, ValueError, OSError) as e:   # ValueError: a malformed value in config.json
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {path}")


@click.command("export")
@click.argument("draft", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "output", required=True, type=click.Path(), help="Checkpoint directory to write.")
def export_cmd(draft, output):
    """Export a draft GGUF as a Hugging Face checkpoint (config.json + model.safetensors)."""
    from pyllama_dspark.interop.export import export_checkpoint

    try:
        path = export_checkpoint(draft, output)
    except (DSparkError, ValueError, OSError) as e:   # ValueError: a malformed value in config.json
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {path}")
