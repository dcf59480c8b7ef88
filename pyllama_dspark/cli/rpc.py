"""``pyllama-dspark rpc-server``: llama.cpp's own ``ggml-rpc-server``, built from the vendored sources
on the installed libraries (:mod:`pyllama_dspark.upstream.rpc_build`) and run with its flags."""

from __future__ import annotations

import os
import sys

import click

LOCALHOST = "127.0.0.1"


@click.command("rpc-server", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-H", "--host", default=LOCALHOST, show_default=True, help="Address to bind.")
@click.option("-p", "--port", type=int, default=50052, show_default=True, help="Port to bind.")
@click.option("-t", "--threads", type=int, default=None,
              help="Threads for the CPU device (default: half the cores, as llama.cpp).")
@click.option("-d", "--device", default=None, metavar="DEV1,DEV2,...",
              help="Comma-separated devices to serve (default: the accelerators, else the CPU).")
@click.option("-c", "--cache", is_flag=True, help="Keep large tensors in a local file cache ($LLAMA_CACHE/rpc).")
def rpc_server(host, port, threads, device, cache):
    """Serve this machine's devices to a `--rpc` client (run, serve, bench, llama-server).

    Not secure: anyone who reaches the port can run graphs and read memory on this machine. Bind
    it to 127.0.0.1 or a private network only. One client at a time: each client (one run, one serve
    process) needs its own set of rpc-servers."""
    from pyllama_dspark.upstream.llama_server_sdist import LlamaServerBuildError
    from pyllama_dspark.upstream.rpc_build import rpc_server_binary

    if not 0 < port < 65536:
        raise click.BadParameter("must be in 1..65535", param_hint="--port")
    if threads is not None and threads <= 0:
        raise click.BadParameter("must be >= 1", param_hint="--threads")
    try:
        binary = rpc_server_binary()
    except LlamaServerBuildError as e:
        raise click.ClickException(f"could not build ggml-rpc-server: {e}")
    if host != LOCALHOST:
        click.echo(f"warning: binding the RPC server to {host}: RPC is not secure, never expose it to an open "
                   "network (anyone who reaches it can run code on this machine's devices)", err=True)
    argv = [str(binary), "--host", host, "--port", str(port)]
    if threads is not None:
        argv += ["--threads", str(threads)]
    if device:
        argv += ["--device", device]
    if cache:
        argv += ["--cache"]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)   # the server itself: signals and exit status are its own
