"""What every command shares: the default models as click errors, -md parsed, llama.cpp's sampling flags."""

from __future__ import annotations

from typing import Optional

import click

from pyllama_dspark import paths
from pyllama_dspark.speculative.sampling_params import SamplingParams

_D = SamplingParams()   # llama.cpp's defaults: stated once, in SamplingParams


class NglType(click.ParamType):
    """llama.cpp's ``-ngl`` value: a number of layers, ``auto`` or ``all``."""

    name = "N|auto|all"

    def convert(self, value, param, ctx):
        from pyllama_dspark.llama.offload import parse_n_gpu_layers

        try:
            return parse_n_gpu_layers(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


NGL = NglType()
NGL_HELP = ("Layers offloaded to the GPU: a number, 'auto' (every layer when the model fits the GPU's free "
            "memory, fewer when it does not, none without a GPU: nothing changes on a CPU) or 'all'. "
            "As llama.cpp's -ngl.")


def ngl_option(fn):
    """``-ngl/--n-gpu-layers``, llama.cpp's default ``auto``."""
    return click.option("-ngl", "--n-gpu-layers", "n_gpu_layers", type=NGL, default="auto", show_default=True,
                        help=NGL_HELP)(fn)


def sampling_options(fn):
    """llama.cpp's sampling flags (``--temp --top-k --top-p --min-p -s --repeat-penalty
    --repeat-last-n --presence-penalty --frequency-penalty``) with its defaults."""
    opts = [
        click.option("--temp", type=float, default=_D.temperature, show_default=True,
                     help="Temperature; 0 = greedy (exactly the target's greedy output)."),
        click.option("--top-k", "top_k", type=int, default=_D.top_k, show_default=True, help="Top-k sampling (<= 0: off)."),
        click.option("--top-p", "top_p", type=float, default=_D.top_p, show_default=True, help="Top-p sampling (1.0: off)."),
        click.option("--min-p", "min_p", type=float, default=_D.min_p, show_default=True, help="Min-p sampling (0.0: off)."),
        click.option("-s", "--seed", type=int, default=-1, show_default=True, help="RNG seed (-1: random)."),
        click.option("--repeat-penalty", "repeat_penalty", type=float, default=_D.repeat_penalty, show_default=True,
                     help="Repetition penalty over the last --repeat-last-n tokens (1.0: off)."),
        click.option("--repeat-last-n", "repeat_last_n", type=int, default=_D.penalty_last_n, show_default=True,
                     help="Tokens the penalties look back on (0: off, -1: whole sequence)."),
        click.option("--presence-penalty", "presence_penalty", type=float, default=_D.presence_penalty, show_default=True),
        click.option("--frequency-penalty", "frequency_penalty", type=float, default=_D.frequency_penalty,
                     show_default=True),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def sampling_from_options(temp, top_k, top_p, min_p, seed, repeat_penalty, repeat_last_n, presence_penalty,
                          frequency_penalty) -> SamplingParams:
    """The :class:`SamplingParams` of :func:`sampling_options`' values (a usage error if invalid)."""
    try:
        return SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                              repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                              frequency_penalty=frequency_penalty, penalty_last_n=repeat_last_n)
    except (TypeError, ValueError) as e:
        raise click.UsageError(f"bad sampling parameter: {e}")


def default_target() -> str:
    """The default target's path, or a usage error saying how to get it."""
    try:
        return paths.default_target()
    except paths.MissingDefaultModel as e:
        raise click.UsageError(str(e))


def load_prompt_items(prompts, limit: int):
    """Prompt files (or the packaged benchmark prompts) as PromptItems; click errors if none."""
    from pyllama_dspark.prompts import load_prompts

    try:
        items = load_prompts(list(prompts), limit_per_file=limit)
    except (OSError, ValueError) as e:
        raise click.ClickException(str(e))
    if not items:
        raise click.ClickException("no prompts found")
    return items


def draft_arg(draft: Optional[str], *, dflash_mode: bool = False):
    """-md's value as a :class:`~pyllama_dspark.drafts.spec.DraftSpec` (None: none); a usage error
    when it is malformed (an unknown ':TYPE', 'oracle' without a P in [0, 1])."""
    from pyllama_dspark.drafts.spec import parse_draft

    try:
        return parse_draft(draft, dflash_mode=dflash_mode)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="-md")


def draft_file(spec, target: str) -> Optional[str]:
    """The GGUF file ``spec`` names beside ``target`` (a generated one written first); None for none."""
    if spec is None:
        return None
    try:
        return spec.file(target)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="-md")


def offload_options(fn):
    """llama-server's ``--rpc``, ``-ts/--tensor-split``, ``-ngld`` and ``-bs/--backend-sampling``,
    handed to the command as one ``offload`` dict of :class:`~pyllama_dspark.decode.api.Speculator`
    keyword arguments."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, rpc=None, tensor_split=None, n_gpu_layers_draft=None, backend_sampling=None, **kw):
        from pyllama_dspark.llama.rpc import RpcEndpointError, parse_endpoints

        try:
            endpoints = parse_endpoints(rpc) if rpc else ()
        except RpcEndpointError as e:
            raise click.BadParameter(str(e), param_hint="--rpc")
        split = ()
        if tensor_split:
            try:
                split = tuple(float(x) for x in tensor_split.replace("/", ",").split(","))
            except ValueError:
                raise click.BadParameter(f"{tensor_split!r}: expected proportions like 3,1", param_hint="-ts")
        kw["offload"] = dict(rpc=endpoints, tensor_split=split, n_gpu_layers_draft=n_gpu_layers_draft,
                             backend_sampling=backend_sampling or "auto")
        return fn(*args, **kw)

    opts = [
        click.option("--rpc", "rpc", default=None, envvar="LLAMA_ARG_RPC", metavar="SERVERS",
                     help="Comma-separated RPC servers (host:port) the offloaded layers (-ngl) go to; start "
                          "them with `pyllama-dspark rpc-server` (docs/scale-out.md)."),
        click.option("-ts", "--tensor-split", "tensor_split", default=None, metavar="N0,N1,...",
                     help="Share of the offloaded layers per device (RPC servers first), e.g. 3,1."),
        click.option("-ngld", "--n-gpu-layers-draft", "n_gpu_layers_draft", type=NGL, default=None,
                     help="The draft's offloaded layers, as -ngl (default: as -ngl, resolved for the draft's own "
                          "file; 0 keeps the draft local)."),
        click.option("-bs", "--backend-sampling", "backend_sampling", flag_value="on", default=None,
                     help="Read greedy rows out on the device (llama.cpp's backend sampling: each row's top 2 "
                          "comes back, no logits row). Default: on when layers are offloaded (-ngl), off on a CPU."),
        click.option("--no-backend-sampling", "backend_sampling", flag_value="off",
                     help="Copy every output row's logits to the host, also on a GPU."),
    ]
    for o in reversed(opts):
        wrapper = o(wrapper)
    return wrapper
