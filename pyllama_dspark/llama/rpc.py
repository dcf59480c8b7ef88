"""llama.cpp's RPC backend in this process: the model's layers on remote ``ggml-rpc-server``\\ s.

What llama.cpp's own ``--rpc`` does (common/arg.cpp ``add_rpc_devices``), from Python:
``ggml_backend_load`` of the RPC module, ``ggml_backend_reg_by_name("RPC")``, its
``ggml_backend_rpc_add_server`` per endpoint, and ``ggml_backend_register`` of what it returns.
Then a model loaded with ``n_gpu_layers`` > 0 spreads its layers over those devices.

llama.cpp's RPC client calls ``GGML_ABORT`` when a connect, send or receive fails (ggml-rpc.cpp),
which no Python code can catch.  So, before anything reaches it:

- every endpoint is probed here (TCP connect and the protocol's HELLO, with a timeout): a closed
  port, an unreachable host, a busy server (an rpc-server serves one client at a time) or a
  protocol mismatch is an :class:`RpcEndpointError`;
- an abort callback (``ggml_set_abort_callback``) turns a server lost later, mid-generation, into
  one clear last line on stderr and exit status 1, instead of an abort with a backtrace.

The module itself (``libggml-rpc.so``) is built by :mod:`pyllama_dspark.upstream.rpc_build`; the
package installs that builder as this module's provider (``set_module_provider``).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from pyllama_dspark.errors import DSparkError

PROTO_MAJOR, PROTO_MINOR = 7, 0   # RPC_PROTO_*_VERSION of ggml-rpc.h at the vendored commit
CMD_HELLO = 14                    # RPC_CMD_HELLO (fixed by the protocol)
CONN_CAPS_SIZE = 24               # RPC_CONN_CAPS_SIZE (transport.h)
PROBE_TIMEOUT_S = 5.0
DEV_TYPE_GPU, DEV_TYPE_IGPU = 1, 2  # enum ggml_backend_dev_type

Endpoints = Union[str, Sequence[str], None]


class RpcEndpointError(DSparkError, ConnectionError):
    """An RPC endpoint that is malformed, unreachable, busy or speaks another protocol version."""


def parse_endpoints(value: Endpoints) -> Tuple[str, ...]:
    """``"host:port,host:port"`` (llama-server's ``--rpc``) or a sequence of them, checked."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    out: List[str] = []
    for item in items:
        ep = str(item).strip()
        host, sep, port = ep.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RpcEndpointError(f"bad RPC endpoint {ep!r}: expected host:port (e.g. 127.0.0.1:50052)")
        if ep not in out:
            out.append(ep)
    if isinstance(value, str) and not out:
        raise RpcEndpointError("--rpc: no RPC servers given")
    return tuple(out)


def _recv_exact(sock, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("closed by the server")
        buf += part
    return buf


def probe(endpoint: str, timeout: float = PROBE_TIMEOUT_S) -> Tuple[int, int, int]:
    """The server's protocol version after a HELLO, or :class:`RpcEndpointError` saying why not."""
    import socket
    import struct

    host, _, port = endpoint.rpartition(":")
    where = f"RPC server {endpoint}"
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except ConnectionRefusedError:
        raise RpcEndpointError(f"{where}: connection refused (is `pyllama-dspark rpc-server` running there, "
                               "on that port?)") from None
    except socket.timeout:
        raise RpcEndpointError(f"{where}: unreachable (no answer to connect within {timeout:g} s)") from None
    except OSError as e:
        raise RpcEndpointError(f"{where}: unreachable ({e.strerror or e})") from None
    try:
        with sock:
            # | cmd (1 byte) | request size (8 bytes) | request | -> | response size (8 bytes) | response |
            sock.sendall(struct.pack("<BQ", CMD_HELLO, CONN_CAPS_SIZE) + bytes(CONN_CAPS_SIZE))
            size = struct.unpack("<Q", _recv_exact(sock, 8))[0]
            if size != 4 + CONN_CAPS_SIZE:
                raise RpcEndpointError(f"{where}: not a llama.cpp RPC server of this version "
                                       f"(HELLO answer of {size} bytes)")
            major, minor, patch = _recv_exact(sock, 4)[:3]
    except socket.timeout:
        raise RpcEndpointError(f"{where}: accepted the connection but did not answer within {timeout:g} s "
                               "(an rpc-server serves one client at a time: is another process using it?)") from None
    except (ConnectionError, OSError) as e:
        raise RpcEndpointError(f"{where}: the handshake failed ({e})") from None
    if major != PROTO_MAJOR or minor > PROTO_MINOR:
        raise RpcEndpointError(f"{where}: speaks RPC protocol {major}.{minor}.{patch}, this llama.cpp "
                               f"speaks {PROTO_MAJOR}.{PROTO_MINOR}.x: run the rpc-server of the same llama.cpp")
    return major, minor, patch


# ---- the backend in this process -----------------------------------------------------------------

_lock = threading.Lock()
_module_provider: Optional[Callable[[], str]] = None
_servers: Dict[str, List[int]] = {}   # endpoint -> its devices (ggml_backend_dev_t)
_abort_cb = None                      # the installed ctypes callback (kept alive)


def set_module_provider(fn: Callable[[], str]) -> None:
    """``fn()`` returns the path of ``libggml-rpc.so`` (building it if needed)."""
    global _module_provider
    _module_provider = fn


def _ggml():
    import ctypes
    from ctypes import c_char_p, c_size_t, c_void_p

    import llama_cpp  # noqa: F401  (libllama and its libggml loaded, RTLD_GLOBAL)

    lib = ctypes.CDLL(None)
    # ggml-backend.h prototypes used here
    lib.ggml_backend_reg_by_name.argtypes, lib.ggml_backend_reg_by_name.restype = [c_char_p], c_void_p
    lib.ggml_backend_load.argtypes, lib.ggml_backend_load.restype = [c_char_p], c_void_p
    lib.ggml_backend_reg_get_proc_address.argtypes = [c_void_p, c_char_p]
    lib.ggml_backend_reg_get_proc_address.restype = c_void_p
    lib.ggml_backend_register.argtypes, lib.ggml_backend_register.restype = [c_void_p], None
    lib.ggml_backend_reg_dev_count.argtypes, lib.ggml_backend_reg_dev_count.restype = [c_void_p], c_size_t
    lib.ggml_backend_reg_dev_get.argtypes = [c_void_p, c_size_t]
    lib.ggml_backend_reg_dev_get.restype = c_void_p
    lib.ggml_backend_dev_count.argtypes, lib.ggml_backend_dev_count.restype = [], c_size_t
    lib.ggml_backend_dev_get.argtypes, lib.ggml_backend_dev_get.restype = [c_size_t], c_void_p
    lib.ggml_backend_dev_type.argtypes, lib.ggml_backend_dev_type.restype = [c_void_p], ctypes.c_int
    lib.ggml_set_abort_callback.argtypes = [c_void_p]
    lib.ggml_set_abort_callback.restype = c_void_p
    return lib


def _on_abort(message: bytes) -> None:
    eps = ", ".join(_servers) or "?"
    text = (message or b"").decode("utf-8", "replace")
    line = (f"pyllama-dspark: fatal: llama.cpp aborted ({text.strip()}); with RPC servers in use ({eps}) this "
            "means one was lost or failed. Exiting with status 1: restart this process (a supervisor's "
            "Restart=, or the other replicas behind the load balancer, see docs/scale-out.md).\n")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
    os.write(2, line.encode())
    os._exit(1)


def _install_abort_callback(lib) -> None:
    import ctypes

    global _abort_cb
    if _abort_cb is None:
        # typedef void (*ggml_abort_callback_t)(const char * error_message);
        _abort_cb = ctypes.CFUNCTYPE(None, ctypes.c_char_p)(_on_abort)
        lib.ggml_set_abort_callback(ctypes.cast(_abort_cb, ctypes.c_void_p))


def add_servers(endpoints: Endpoints, *, timeout: float = PROBE_TIMEOUT_S) -> List[int]:
    """Probes, then registers each endpoint's devices as llama.cpp's ``--rpc`` does (once per
    endpoint and process); returns their devices in endpoint order."""
    eps = parse_endpoints(endpoints)
    if not eps:
        return []
    with _lock:
        new = [ep for ep in eps if ep not in _servers]
        for ep in new:
            probe(ep, timeout)
        if new:
            lib = _ggml()
            reg = lib.ggml_backend_reg_by_name(b"RPC")
            if not reg:
                if _module_provider is None:
                    raise RpcEndpointError("llama.cpp's RPC backend is not loaded and no module provider is set")
                path = os.fsencode(os.fspath(_module_provider()))
                reg = lib.ggml_backend_load(path)
                if not reg:
                    raise RpcEndpointError(f"ggml_backend_load could not load the RPC backend {path.decode()}")
            fn = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
            if not fn:
                raise RpcEndpointError("the RPC backend has no ggml_backend_rpc_add_server")
            import ctypes

            add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(fn)
            _install_abort_callback(lib)
            for ep in new:
                ep_reg = add_server(ep.encode())
                if not ep_reg:
                    raise RpcEndpointError(f"RPC server {ep}: reports no devices")
                lib.ggml_backend_register(ep_reg)
                _servers[ep] = [lib.ggml_backend_reg_dev_get(ep_reg, i)
                                for i in range(lib.ggml_backend_reg_dev_count(ep_reg))]
        return [dev for ep in eps for dev in _servers[ep]]


def in_use() -> bool:
    """Whether RPC devices are registered in this process (a model's devices are then explicit)."""
    return bool(_servers)


def local_gpu_devices() -> List[int]:
    """Registered GPU / iGPU devices that are not RPC devices, in registry order."""
    lib = _ggml()
    remote = {dev for devs in _servers.values() for dev in devs}
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        if dev not in remote and lib.ggml_backend_dev_type(dev) in (DEV_TYPE_GPU, DEV_TYPE_IGPU):
            out.append(dev)
    return out


def model_devices(endpoints: Endpoints):
    """A NULL-terminated ``ggml_backend_dev_t`` array for ``llama_model_params.devices``: the RPC
    devices of ``endpoints`` first, then the local GPUs (llama.cpp's default order), so that a
    model opened without ``--rpc`` in a process that has RPC servers stays local."""
    import ctypes

    devs = add_servers(endpoints) + local_gpu_devices()
    return (ctypes.c_void_p * (len(devs) + 1))(*devs, None)
