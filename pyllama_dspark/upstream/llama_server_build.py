"""Builds ``llama-server`` (CPU only, Release) from the llama.cpp sources of
:mod:`.llama_server_sdist` and caches the binary: one builder at a time (file lock), the binary
moved into place only after a good build.  Its own sources linked to the libraries the installed
llama-cpp-python compiled (:mod:`.llama_server_linked`, a couple of minutes) when they are there,
else the whole tree, static (about ten).  Only the standard library is used (``subprocess`` for
cmake)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from pyllama_dspark.upstream.llama_server_linked import FEATURES, configure_command, installed_lib_dir
from pyllama_dspark.upstream.llama_server_sdist import (LlamaServerBuildError, PathLike, extract_llama_cpp,
                                                     llama_cpp_python_version, llama_server_cache_dir, locate_sdist,
                                                     log_progress)

ENV_CMAKE_ARGS = "PYLLAMA_DSPARK_CMAKE_ARGS"  # extra cmake -D... args (shell-split)
ENV_BUILD_JOBS = "PYLLAMA_DSPARK_BUILD_JOBS"
ENV_BUILD = "PYLLAMA_DSPARK_SERVER_BUILD"      # "static": always build the whole tree


def cmake_configure_args(extra: Sequence[str] = ()) -> List[str]:
    """The cmake ``-D`` options used for llama-server.

    CPU only, Release, static (the binary needs no shared library next to it), no network at
    build time (no OpenSSL, no prebuilt Web UI download, no llguidance), no tests/examples.
    ``GGML_NATIVE=ON`` is llama.cpp's own default (and what a plain ``pip install
    llama-cpp-python`` builds with: its CMakeLists only forces it OFF for wasm), so the CPU
    kernels match the installed libggml-cpu. ``LLAMA_CURL`` is deprecated (ignored) at this commit.
    """
    args = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DGGML_NATIVE=ON",
        "-DGGML_CCACHE=OFF",
        "-DLLAMA_BUILD_COMMON=ON",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_APP=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_LLGUIDANCE=OFF",
        "-DGGML_RPC=ON",  # RPC built in: --rpc works, and the tree also gives ggml-rpc-server
    ]
    env_extra = os.environ.get(ENV_CMAKE_ARGS, "").strip()
    if env_extra:
        import shlex

        args.extend(shlex.split(env_extra))
    args.extend(extra)
    return args


def _find_tool(*names: str) -> Optional[str]:
    for name in names:
        if not name:
            continue
        found = shutil.which(name)
        if found:
            return found
    return None


def _check_toolchain() -> Tuple[str, Optional[str]]:
    cmake = _find_tool("cmake")
    if cmake is None:
        raise LlamaServerBuildError(
            "cmake was not found on PATH; it is needed to build llama-server "
            "(install it, e.g. `pip install cmake` or your OS package manager)")
    try:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise LlamaServerBuildError(f"cmake at {cmake} does not run: {exc}") from exc
    m = re.search(r"version (\d+)\.(\d+)", out)
    if m and (int(m.group(1)), int(m.group(2))) < (3, 14):
        raise LlamaServerBuildError(f"cmake {m.group(0)} is too old to build llama.cpp (need >= 3.14)")
    cxx = _find_tool(os.environ.get("CXX", ""), "c++", "g++", "clang++")
    cc = _find_tool(os.environ.get("CC", ""), "cc", "gcc", "clang")
    if cxx is None or cc is None:
        raise LlamaServerBuildError(
            "no C/C++ compiler found (looked for $CC/$CXX, cc/gcc/clang and c++/g++/clang++); "
            "a C++17 compiler is needed to build llama-server")
    ninja = _find_tool("ninja")
    return cmake, ninja


@contextlib.contextmanager
def _file_lock(path: Path):
    """Exclusive advisory lock (flock) for the whole build; released when the process dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(path), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            fcntl = None  # type: ignore
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                log_progress(f"another process is building llama-server ({path}); waiting for it ...")
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)



def _run_logged(cmd: Sequence[str], log, cwd: Optional[Path] = None, progress: bool = True) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(list(cmd), cwd=str(cwd) if cwd else None, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, errors="replace")
    assert proc.stdout is not None
    last = 0.0
    tail: List[str] = []
    for line in proc.stdout:
        log.write(line)
        tail.append(line)
        if len(tail) > 60:
            tail.pop(0)
        m = re.match(r"\[(\d+)/(\d+)\]", line) or re.match(r"\[\s*(\d+)%\]", line)
        if progress and m and time.monotonic() - last > 15:
            last = time.monotonic()
            log_progress("  build " + line.strip()[:120])
    rc = proc.wait()
    log.flush()
    if rc != 0:
        raise LlamaServerBuildError(
            f"command failed (rc={rc}): {' '.join(cmd)}\n--- last lines ---\n{''.join(tail)}")


def _build_linked(root: Path, src: Path, lib: Path, cmake: str, ninja: Optional[str], jobs: int) -> Path:
    """Only llama-server's own sources, linked to the installed llama-cpp-python libraries."""
    build = root / "build-linked"
    if build.exists():
        shutil.rmtree(build)
    log_progress(f"building llama-server on llama-cpp-python's libraries in {lib} (-j{jobs}); "
                 f"log: {root / 'build.log'}")
    with open(root / "build.log", "w") as log:
        _run_logged(configure_command(cmake, ninja, src, root / "linked-project", build, lib), log, progress=False)
        _run_logged([cmake, "--build", str(build), "--target", "llama-server", "-j", str(jobs)], log)
    built = build / "llama-server"
    if not built.is_file():
        raise LlamaServerBuildError(f"build finished but {built} does not exist; see {root / 'build.log'}")
    return built


def _build_static(root: Path, src: Path, cmake: str, ninja: Optional[str], jobs: int, cmake_args: Sequence[str],
                  t0: float):
    """The whole llama.cpp tree (ggml, llama, common, mtmd, server), static: (binary, args, t_configured)."""
    build = root / "build"
    cache = build / "CMakeCache.txt"
    if cache.is_file():
        text = cache.read_text(errors="replace")
        m = re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.*)$", text, re.M)
        gen = re.search(r"^CMAKE_GENERATOR:INTERNAL=(.*)$", text, re.M)
        want_gen = "Ninja" if ninja else "Unix Makefiles"
        if (m and Path(m.group(1)).resolve() != src.resolve()) or (gen and gen.group(1) != want_gen):
            log_progress("stale cmake build tree; starting over")
            shutil.rmtree(build)
    args = cmake_configure_args(cmake_args)
    configure = [cmake, "-S", str(src), "-B", str(build)]
    if ninja:
        configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    configure += args
    log_progress(f"building llama.cpp's llama-server in {build} (-j{jobs}); "
                 f"this takes a while, log: {root / 'build.log'}")
    with open(root / "build.log", "w") as log:
        _run_logged(configure, log, progress=False)
        t1 = time.monotonic()
        _run_logged([cmake, "--build", str(build), "--target", "llama-server", "--config", "Release",
                     "-j", str(jobs)], log)
    built = build / "bin" / "llama-server"
    if not built.is_file():
        raise LlamaServerBuildError(f"build finished but {built} does not exist; see {root / 'build.log'}")
    return built, args, t1


def _extracted(root: Path, version: str, sdist: Optional[PathLike]) -> Path:
    """``root/src``: the sdist's vendor/llama.cpp, extracted once (call under the root's lock)."""
    src = root / "src"
    if not (src / "CMakeLists.txt").is_file() or not (src / ".extracted").is_file():
        sd = locate_sdist(version, root, sdist)
        log_progress(f"extracting vendor/llama.cpp from {sd}")
        extract_llama_cpp(sd, src)
        (src / ".extracted").write_text(str(sd) + "\n")
    return src


def vendored_llama_cpp(cache_dir: Optional[PathLike] = None, *, version: Optional[str] = None,
                       sdist: Optional[PathLike] = None) -> Path:
    """The llama.cpp sources the installed llama-cpp-python was built from (its sdist's
    vendor/llama.cpp: convert_hf_to_gguf.py, gguf-py, tools/...), downloaded and extracted into the
    cache on first use."""
    version = version or llama_cpp_python_version()
    root = llama_server_cache_dir(cache_dir, version)
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / ".lock"):
        return _extracted(root, version, sdist)


def ensure_llama_server(cache_dir: Optional[PathLike] = None, *, version: Optional[str] = None,
                        sdist: Optional[PathLike] = None, jobs: Optional[int] = None,
                        cmake_args: Sequence[str] = (), rebuild: bool = False) -> Path:
    """Return the path of a built ``llama-server``, building it first if it is not cached.

    The source is ``vendor/llama.cpp`` of the llama-cpp-python sdist of the installed version
    (or ``version``), taken from ``sdist`` / ``$PYLLAMA_DSPARK_SDIST`` / the cache, or downloaded
    from PyPI. Only the ``llama-server`` target is built (Release, CPU, ``-j jobs``; jobs
    defaults to ``$PYLLAMA_DSPARK_BUILD_JOBS`` or 2): linked to the installed llama-cpp-python's
    libraries when they are all there (``$PYLLAMA_DSPARK_SERVER_BUILD=static`` or ``cmake_args``
    build the whole tree instead), the whole tree when that fails. A file lock serialises concurrent callers
    (e.g. two pytest processes); the binary is moved into ``bin/`` only after a successful build.
    Progress goes to stderr, the full compiler output to ``build.log``.
    """
    version = version or llama_cpp_python_version()
    root = llama_server_cache_dir(cache_dir, version)
    binary = root / "bin" / "llama-server"
    if binary.is_file() and os.access(binary, os.X_OK) and not rebuild:
        return binary

    cmake, ninja = _check_toolchain()
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / ".lock"):
        if binary.is_file() and os.access(binary, os.X_OK) and not rebuild:
            return binary  # another process built it while we waited
        t0 = time.monotonic()
        src = _extracted(root, version, sdist)
        jobs = int(jobs or os.environ.get(ENV_BUILD_JOBS) or 2)
        built, how = None, None
        lib = None if os.environ.get(ENV_BUILD) == "static" or cmake_args else installed_lib_dir()
        if lib is not None:
            try:
                built, args, t1 = _build_linked(root, src, lib, cmake, ninja, jobs), [f"linked to {lib}"], t0
                how = "linked"
            except LlamaServerBuildError as e:
                log_progress(f"building llama-server on the installed libraries failed ({str(e)[:200]}); "
                             "building the whole llama.cpp tree instead")
        if built is None:
            built, args, t1 = _build_static(root, src, cmake, ninja, jobs, cmake_args, t0)
            how = "static"
        t2 = time.monotonic()
        (root / "bin").mkdir(exist_ok=True)
        tmp = root / "bin" / f".llama-server.tmp-{os.getpid()}"
        shutil.copy2(built, tmp)
        os.chmod(tmp, 0o755)
        info = {
            "llama_cpp_python_version": version,
            "build": how,
            "cmake_args": args,
            "features": list(FEATURES) if how == "linked" else [],
            "generator": "Ninja" if ninja else "Unix Makefiles",
            "jobs": jobs,
            "configure_s": round(t1 - t0, 1),
            "build_s": round(t2 - t1, 1),
            "total_s": round(t2 - t0, 1),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (root / "bin" / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
        os.replace(tmp, binary)
        log_progress(f"llama-server built ({how}) in {t2 - t0:.0f} s -> {binary}")
        return binary
