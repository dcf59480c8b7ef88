"""llama.cpp's RPC backend (``libggml-rpc.so``) and its server (``ggml-rpc-server``), built from the
vendored sources and linked to the libraries the installed llama-cpp-python compiled, then cached.

The backend is a loadable module (``GGML_BACKEND_DL``: it exports ``ggml_backend_init``), which is
how llama.cpp's own ``--rpc`` finds it: ``ggml_backend_load`` in this process (see
:mod:`pyllama_dspark.llama.rpc`), ``ggml_backend_load_all`` in llama-server and ggml-rpc-server,
which search their executable's folder.  So all three live in one folder, next to the cached
llama-server (``<cache>/llama-cpp-python-<v>/bin``): the linked llama-server gets ``--rpc`` too.

Two compile units against ~200 for the whole tree: well under a minute on two cores.  When the
installed libraries are not there (or this build fails), the fallback is llama.cpp's whole tree,
static, with ``GGML_RPC=ON``: that gives ``ggml-rpc-server`` and an RPC-enabled llama-server,
but no module this Python process can load (a static backend lives inside its executable), so
``--rpc`` on ``run`` / ``serve`` / ``DSpark`` then stops with :class:`RpcUnavailable`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Optional

from pyllama_dspark.errors import DSparkError
from pyllama_dspark.upstream.llama_server_build import (_check_toolchain, _extracted, _file_lock, _run_logged,
                                                     ensure_llama_server)
from pyllama_dspark.upstream.llama_server_linked import FEATURES, installed_lib_dir
from pyllama_dspark.upstream.llama_server_sdist import (LlamaServerBuildError, PathLike, llama_cpp_python_version,
                                                     llama_server_cache_dir, log_progress)

MODULE = "libggml-rpc.so"
SERVER = "ggml-rpc-server"

# ggml-rpc as ggml's CMake builds it with GGML_BACKEND_DL (ggml/src/CMakeLists.txt,
# ggml_add_backend_library: a MODULE with GGML_BACKEND_DL / GGML_BACKEND_BUILD / GGML_BACKEND_SHARED,
# linked to ggml-base) and tools/rpc's server (linked to ggml), both on the installed libraries
CMAKELISTS = r"""
cmake_minimum_required(VERSION 3.14)
project(ggml_rpc_linked C CXX)
set(CMAKE_CXX_STANDARD 17)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
if (NOT CMAKE_BUILD_TYPE)
    set(CMAKE_BUILD_TYPE Release)
endif()
find_package(Threads REQUIRED)
set(G ${LLAMA_SRC}/ggml)

add_library(ggml-rpc MODULE ${G}/src/ggml-rpc/ggml-rpc.cpp ${G}/src/ggml-rpc/transport.cpp)
target_include_directories(ggml-rpc PRIVATE ${G}/include ${G}/src ${G}/src/ggml-rpc)
target_compile_definitions(ggml-rpc PRIVATE GGML_BACKEND_DL GGML_BACKEND_BUILD GGML_BACKEND_SHARED GGML_SHARED)
target_link_libraries(ggml-rpc PRIVATE ${LLAMA_LIB}/libggml.so ${LLAMA_LIB}/libggml-base.so Threads::Threads)
set_target_properties(ggml-rpc PROPERTIES PREFIX "lib" BUILD_RPATH "${LLAMA_LIB}")

add_executable(ggml-rpc-server ${LLAMA_SRC}/tools/rpc/rpc-server.cpp)
target_include_directories(ggml-rpc-server PRIVATE ${G}/include)
target_compile_definitions(ggml-rpc-server PRIVATE GGML_SHARED)
target_link_libraries(ggml-rpc-server PRIVATE ${LLAMA_LIB}/libggml.so ${LLAMA_LIB}/libggml-base.so Threads::Threads)
set_target_properties(ggml-rpc-server PROPERTIES BUILD_RPATH "${LLAMA_LIB}")
"""


class RpcUnavailable(DSparkError, RuntimeError):
    """llama.cpp's RPC backend cannot be built or loaded here."""


def rpc_bin_dir(cache_dir: Optional[PathLike] = None, version: Optional[str] = None) -> Path:
    """The folder of the cached llama-server, ``libggml-rpc.so`` and ``ggml-rpc-server``."""
    return llama_server_cache_dir(cache_dir, version or llama_cpp_python_version()) / "bin"


def _build_linked(root: Path, src: Path, lib: Path, jobs: int) -> Path:
    cmake, ninja = _check_toolchain()
    project, build = root / "rpc-project", root / "build-rpc"
    if build.exists():
        shutil.rmtree(build)
    project.mkdir(parents=True, exist_ok=True)
    (project / "CMakeLists.txt").write_text(CMAKELISTS)
    cfg = [cmake, "-S", str(project), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", f"-DLLAMA_SRC={src}",
           f"-DLLAMA_LIB={lib}"]
    if ninja:
        cfg += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    log_progress(f"building llama.cpp's RPC backend and ggml-rpc-server on {lib}; log: {root / 'build-rpc.log'}")
    with open(root / "build-rpc.log", "w") as log:
        _run_logged(cfg, log, progress=False)
        _run_logged([cmake, "--build", str(build), "-j", str(jobs)], log)
    for name in (MODULE, SERVER):
        if not (build / name).is_file():
            raise LlamaServerBuildError(f"build finished but {build / name} does not exist; "
                                        f"see {root / 'build-rpc.log'}")
    return build


def _build_static_server(root: Path, src: Path, jobs: int) -> Path:
    """The whole tree, static, GGML_RPC=ON: ggml-rpc-server only (no loadable module)."""
    cmake, ninja = _check_toolchain()
    from pyllama_dspark.upstream.llama_server_build import cmake_configure_args

    build = root / "build"  # llama-server's static tree (its arguments have GGML_RPC=ON)
    cfg = [cmake, "-S", str(src), "-B", str(build)] + cmake_configure_args()
    if ninja:
        cfg += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    log_progress("building llama.cpp's whole tree with GGML_RPC=ON for ggml-rpc-server (static; takes a while)")
    with open(root / "build-rpc.log", "w") as log:
        _run_logged(cfg, log, progress=False)
        _run_logged([cmake, "--build", str(build), "--target", SERVER, "-j", str(jobs)], log)
    return build / "bin"


def ensure_rpc(cache_dir: Optional[PathLike] = None, *, jobs: Optional[int] = None,
               rebuild: bool = False) -> Path:
    """The folder holding ``ggml-rpc-server`` and (linked build) ``libggml-rpc.so``, built first if
    not cached.  The linked llama-server is built too (the RPC backend goes next to it)."""
    version = llama_cpp_python_version()
    root = llama_server_cache_dir(cache_dir, version)
    out = root / "bin"
    if (out / SERVER).is_file() and not rebuild:
        return out
    ensure_llama_server(cache_dir)
    info = json.loads((out / "build-info.json").read_text()) if (out / "build-info.json").is_file() else {}
    if info.get("build") == "linked" and not set(FEATURES) <= set(info.get("features") or ()):
        # cached before llama-server loaded the backends beside it: rebuilt once, so its --rpc works
        ensure_llama_server(cache_dir, rebuild=True)
        info = json.loads((out / "build-info.json").read_text())
    with _file_lock(root / ".lock"):
        if (out / SERVER).is_file() and not rebuild:
            return out
        t0 = time.monotonic()
        src = _extracted(root, version, None)
        jobs = int(jobs or os.environ.get("PYLLAMA_DSPARK_BUILD_JOBS") or 2)
        lib = installed_lib_dir() if info.get("build") == "linked" else None
        built, names, how = None, (MODULE, SERVER), "linked"
        if lib is not None:
            try:
                built = _build_linked(root, src, lib, jobs)
            except LlamaServerBuildError as e:
                log_progress(f"the linked RPC build failed ({str(e)[:200]}); building ggml-rpc-server static")
        if built is None:
            built, names, how = _build_static_server(root, src, jobs), (SERVER,), "static"
        out.mkdir(exist_ok=True)
        for name in names:  # the server last: its presence marks a finished build
            tmp = out / f".{name}.tmp-{os.getpid()}"
            shutil.copy2(built / name, tmp)
            os.replace(tmp, out / name)
        (out / "rpc-build-info.json").write_text(json.dumps(
            {"build": how, "total_s": round(time.monotonic() - t0, 1),
             "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=2) + "\n")
        log_progress(f"RPC backend built ({how}) in {time.monotonic() - t0:.0f} s -> {out}")
        return out


def rpc_module(cache_dir: Optional[PathLike] = None, *, build: bool = True) -> Path:
    """The loadable RPC backend for this process (built on first use), or :class:`RpcUnavailable`
    saying why not."""
    out = ensure_rpc(cache_dir) if build else rpc_bin_dir(cache_dir)
    module = out / MODULE
    if not module.is_file():
        raise RpcUnavailable(
            f"llama.cpp's RPC backend has no loadable module here ({module} is missing): the installed "
            "llama-cpp-python libraries were not usable, so only a static ggml-rpc-server was built. "
            "--rpc needs the module; reinstall llama-cpp-python from source (pip install "
            "--force-reinstall --no-binary llama-cpp-python llama-cpp-python) and try again")
    return module


def rpc_server_binary(cache_dir: Optional[PathLike] = None) -> Path:
    return ensure_rpc(cache_dir) / SERVER
