"""llama.cpp's own ``llama-server`` as a reference DSpark driver (tests, ``crosscheck``).

Two parts:

* :func:`ensure_llama_server` builds ``llama-server`` from the llama.cpp sources vendored in the
  llama-cpp-python sdist of the *installed* version (the very commit of the libllama that
  llama-cpp-python loads), CPU only, and caches the binary.
* :class:`LlamaServer` runs that binary on 127.0.0.1 (optionally with a DSpark/DFlash draft),
  sends token-id prompts to ``POST /completion`` and returns the generated token ids, the server's
  timings (``draft_n`` / ``draft_n_accepted``) and the per-verification-step draft counts parsed
  from the server log (``LLAMA_TRACE=1`` makes the server log ``accepted A/D draft tokens`` once
  per verify step).

Only the standard library is used (``urllib`` for HTTP, ``subprocess`` for cmake and the server).

Cache layout (``PYLLAMA_DSPARK_CACHE`` or ``~/.cache/pyllama-dspark``)::

    llama-cpp-python-<version>/
        llama_cpp_python-<version>.tar.gz   the sdist (downloaded from PyPI when absent)
        src/                                 its vendor/llama.cpp
        build/                               the cmake build tree (kept: a rebuild is incremental)
        build.log                            output of the last configure + build
        bin/llama-server                     the binary (moved into place only after a good build)
        bin/build-info.json                  how it was built and how long it took
        .lock                                file lock: one builder at a time (flock)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from pyllama_dspark.llama.amx import cpu_has_amx
from pyllama_dspark.errors import DSparkError

__all__ = [
    "LlamaServerError",
    "LlamaServerBuildError",
    "ensure_llama_server",
    "llama_server_cache_dir",
    "llama_cpp_python_version",
    "cmake_configure_args",
    "LlamaServer",
    "SpecStep",
    "parse_spec_steps",
    "parse_draft_acceptance",
]

PathLike = Union[str, "os.PathLike[str]"]

ENV_CACHE = "PYLLAMA_DSPARK_CACHE"
ENV_SDIST = "PYLLAMA_DSPARK_SDIST"          # path of a local llama-cpp-python sdist (skips the download)
ENV_CMAKE_ARGS = "PYLLAMA_DSPARK_CMAKE_ARGS"  # extra cmake -D... args (shell-split)
ENV_BUILD_JOBS = "PYLLAMA_DSPARK_BUILD_JOBS"


class LlamaServerError(DSparkError, RuntimeError):
    """llama-server failed to start, died, or answered with an error."""


class LlamaServerBuildError(DSparkError, RuntimeError):
    """llama-server could not be built (missing tool, download or compile failure)."""


def _log(msg: str) -> None:
    print(f"[pyllama-dspark] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# build
# --------------------------------------------------------------------------------------------

def llama_cpp_python_version() -> str:
    """Version of the installed llama-cpp-python (the llama.cpp commit we must build)."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - Python < 3.8
        PackageNotFoundError, version = Exception, None  # type: ignore
    if version is not None:
        for name in ("llama_cpp_python", "llama-cpp-python"):
            try:
                return version(name)
            except PackageNotFoundError:
                pass
    try:
        import llama_cpp  # noqa: WPS433

        return str(llama_cpp.__version__)
    except Exception as exc:  # pragma: no cover
        raise LlamaServerBuildError("llama-cpp-python is not installed; cannot tell which llama.cpp to build") from exc


def llama_server_cache_dir(cache_dir: Optional[PathLike] = None, version: Optional[str] = None) -> Path:
    """The per-version cache directory (not created)."""
    if cache_dir is None:
        cache_dir = os.environ.get(ENV_CACHE) or os.path.join(os.path.expanduser("~"), ".cache", "pyllama-dspark")
    version = version or llama_cpp_python_version()
    return Path(cache_dir).expanduser().resolve() / f"llama-cpp-python-{version}"


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
                _log(f"another process is building llama-server ({path}); waiting for it ...")
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _pypi_sdist_url(version: str) -> Tuple[str, str, Optional[str]]:
    url = f"https://pypi.org/pypi/llama-cpp-python/{version}/json"
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        info = json.load(resp)
    for f in info.get("urls", []):
        if f.get("packagetype") == "sdist":
            return f["url"], f["filename"], (f.get("digests") or {}).get("sha256")
    raise LlamaServerBuildError(f"PyPI lists no sdist for llama-cpp-python {version}")


def _download_sdist(version: str, dest_dir: Path) -> Path:
    """Fetch ``llama_cpp_python-<version>.tar.gz`` from PyPI into dest_dir.

    First ``pip download`` of the sdist (honours the user's pip configuration: index, mirrors,
    proxies) with ``--no-binary llama-cpp-python`` (never ``:all:``, which would build cmake/ninja
    from source for the metadata step) and ``--no-build-isolation`` when scikit-build-core is
    importable (the metadata step then uses it instead of installing it); if that fails, the PyPI
    JSON API: a plain file download checked against PyPI's sha256.
    """
    dest_dir.mkdir(parents=True, exist_ok=True)
    errors = []
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
           f"llama-cpp-python=={version}", "-d", str(dest_dir)]
    try:
        import scikit_build_core  # noqa: F401

        cmd.insert(4, "--no-build-isolation")
    except ImportError:
        pass
    _log("downloading the llama-cpp-python sdist: " + " ".join(cmd[1:]))
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode == 0:
        found = sorted(dest_dir.glob(f"llama_cpp_python-{version}.tar.gz")) + sorted(
            dest_dir.glob(f"llama-cpp-python-{version}.tar.gz"))
        if found:
            return found[0]
        errors.append("pip download succeeded but left no sdist")
    else:
        errors.append(f"pip download (rc={proc.returncode}): {proc.stderr.strip()[-1500:]}")
    _log("pip download failed; trying the PyPI JSON API")
    try:
        url, filename, sha256 = _pypi_sdist_url(version)
        target = dest_dir / filename
        tmp = dest_dir / (filename + f".part-{os.getpid()}")
        _log(f"downloading {url}")
        h = hashlib.sha256()
        with urllib.request.urlopen(url, timeout=300) as resp, open(tmp, "wb") as out:
            while True:
                chunk = resp.read(1 << 20)
                if not chunk:
                    break
                h.update(chunk)
                out.write(chunk)
        if sha256 and h.hexdigest() != sha256:
            tmp.unlink()
            raise LlamaServerBuildError(f"sha256 mismatch for {filename}: got {h.hexdigest()}, PyPI says {sha256}")
        os.replace(tmp, target)
        return target
    except (OSError, urllib.error.URLError, ValueError, KeyError, LlamaServerBuildError) as exc:
        errors.append(f"PyPI JSON API: {exc}")
    raise LlamaServerBuildError(
        f"could not obtain the llama-cpp-python {version} sdist; set {ENV_SDIST}=/path/to/sdist.tar.gz. "
        + " | ".join(errors))


def _locate_sdist(version: str, root: Path, sdist: Optional[PathLike]) -> Path:
    candidates: List[Path] = []
    if sdist is not None:
        candidates.append(Path(sdist))
    if os.environ.get(ENV_SDIST):
        candidates.append(Path(os.environ[ENV_SDIST]))
    candidates += [root / f"llama_cpp_python-{version}.tar.gz", root / f"llama-cpp-python-{version}.tar.gz"]
    for c in candidates:
        if c.is_file():
            return c
    if sdist is not None:
        raise LlamaServerBuildError(f"sdist not found: {sdist}")
    return _download_sdist(version, root)


def _extract_llama_cpp(sdist: Path, dest: Path) -> None:
    """Extract ``<top>/vendor/llama.cpp/**`` of the sdist into ``dest`` (atomically)."""
    tmp = Path(tempfile.mkdtemp(prefix="src.tmp-", dir=str(dest.parent)))
    try:
        n = 0
        with tarfile.open(sdist, "r:*") as tf:
            for member in tf:
                parts = member.name.split("/")
                if len(parts) < 4 or parts[1:3] != ["vendor", "llama.cpp"]:
                    continue
                rel = "/".join(parts[3:])
                if not rel or rel.startswith("/") or ".." in rel.split("/"):
                    continue
                member.name = rel
                if member.issym() or member.islnk():
                    continue  # no links are needed to build; never follow them out of the tree
                if hasattr(tarfile, "data_filter"):
                    tf.extract(member, tmp, filter="data")
                else:  # pragma: no cover - old Python
                    tf.extract(member, tmp)
                n += 1
        if not (tmp / "CMakeLists.txt").is_file() or not (tmp / "tools" / "server").is_dir():
            raise LlamaServerBuildError(f"{sdist} does not contain vendor/llama.cpp with tools/server ({n} files)")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


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
            _log("  build " + line.strip()[:120])
    rc = proc.wait()
    log.flush()
    if rc != 0:
        raise LlamaServerBuildError(
            f"command failed (rc={rc}): {' '.join(cmd)}\n--- last lines ---\n{''.join(tail)}")


def ensure_llama_server(cache_dir: Optional[PathLike] = None, *, version: Optional[str] = None,
                        sdist: Optional[PathLike] = None, jobs: Optional[int] = None,
                        cmake_args: Sequence[str] = (), rebuild: bool = False) -> Path:
    """Return the path of a built ``llama-server``, building it first if it is not cached.

    The source is ``vendor/llama.cpp`` of the llama-cpp-python sdist of the installed version
    (or ``version``), taken from ``sdist`` / ``$PYLLAMA_DSPARK_SDIST`` / the cache, or downloaded
    from PyPI. Only the ``llama-server`` target is built (Release, CPU, ``-j jobs``; jobs
    defaults to ``$PYLLAMA_DSPARK_BUILD_JOBS`` or 2). A file lock serialises concurrent callers
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
        src = root / "src"
        if not (src / "CMakeLists.txt").is_file() or not (src / ".extracted").is_file():
            sd = _locate_sdist(version, root, sdist)
            _log(f"extracting vendor/llama.cpp from {sd}")
            _extract_llama_cpp(sd, src)
            (src / ".extracted").write_text(str(sd) + "\n")
        build = root / "build"
        cache = build / "CMakeCache.txt"
        if cache.is_file():
            text = cache.read_text(errors="replace")
            m = re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.*)$", text, re.M)
            gen = re.search(r"^CMAKE_GENERATOR:INTERNAL=(.*)$", text, re.M)
            want_gen = "Ninja" if ninja else "Unix Makefiles"
            if (m and Path(m.group(1)).resolve() != src.resolve()) or (gen and gen.group(1) != want_gen):
                _log("stale cmake build tree; starting over")
                shutil.rmtree(build)
        jobs = int(jobs or os.environ.get(ENV_BUILD_JOBS) or 2)
        args = cmake_configure_args(cmake_args)
        configure = [cmake, "-S", str(src), "-B", str(build)]
        if ninja:
            configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        configure += args
        _log(f"building llama-server for llama-cpp-python {version} in {build} (-j{jobs}); "
             f"this takes a while, log: {root / 'build.log'}")
        with open(root / "build.log", "w") as log:
            _run_logged(configure, log, progress=False)
            t1 = time.monotonic()
            _run_logged([cmake, "--build", str(build), "--target", "llama-server", "--config", "Release",
                         "-j", str(jobs)], log)
        built = build / "bin" / "llama-server"
        if not built.is_file():
            raise LlamaServerBuildError(f"build finished but {built} does not exist; see {root / 'build.log'}")
        t2 = time.monotonic()
        (root / "bin").mkdir(exist_ok=True)
        tmp = root / "bin" / f".llama-server.tmp-{os.getpid()}"
        shutil.copy2(built, tmp)
        os.chmod(tmp, 0o755)
        info = {
            "llama_cpp_python_version": version,
            "cmake_args": args,
            "generator": "Ninja" if ninja else "Unix Makefiles",
            "jobs": jobs,
            "configure_s": round(t1 - t0, 1),
            "build_s": round(t2 - t1, 1),
            "total_s": round(t2 - t0, 1),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (root / "bin" / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
        os.replace(tmp, binary)
        _log(f"llama-server built in {t2 - t0:.0f} s -> {binary}")
        return binary


# --------------------------------------------------------------------------------------------
# log parsing
# --------------------------------------------------------------------------------------------

class SpecStep(Tuple[int, int]):
    """One verification step: (n_drafted, n_accepted). ``task`` / ``slot`` are kept as attributes."""

    task: int
    slot: int

    def __new__(cls, n_drafted: int, n_accepted: int, task: int = -1, slot: int = -1):
        obj = super().__new__(cls, (n_drafted, n_accepted))
        obj.task = task
        obj.slot = slot
        return obj

    @property
    def n_drafted(self) -> int:
        return self[0]

    @property
    def n_accepted(self) -> int:
        return self[1]


# LLAMA_TRACE=1 (server-context.cpp, post_decode): "accepted %2zu/%2zu draft tokens" at INFO level,
# optionally followed by " (restore checkpoint)"; debug level (-lv 5) also prints
# "accepted %d/%d draft tokens, new n_tokens = %d" for the same step -- used only as a fallback.
_RE_TRACE = re.compile(
    r"id\s+(\d+) \| task (-?\d+) \| accepted\s+(\d+)/\s*(\d+) draft tokens(?P<rest>[^\n]*)")
_RE_ACCEPTANCE = re.compile(
    r"id\s+(\d+) \| task (-?\d+) \| draft acceptance = ([0-9.]+) \(\s*(\d+) accepted /\s*(\d+) generated\)")


def parse_spec_steps(log_text: str, task: Optional[int] = None) -> List[SpecStep]:
    """Per-verification-step (n_drafted, n_accepted) from a llama-server log.

    Needs ``LLAMA_TRACE=1`` in the server's environment (or ``-lv 5``). n_accepted counts the
    draft tokens that matched the target (the target's own token after them is not included),
    exactly the quantity summed into ``timings.draft_n_accepted``. Steps where nothing was
    drafted (plain decoding) are not logged and therefore not listed.
    """
    trace: List[SpecStep] = []
    debug: List[SpecStep] = []
    for m in _RE_TRACE.finditer(log_text):
        slot, t, acc, drafted = int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4))
        if task is not None and t != task:
            continue
        step = SpecStep(drafted, acc, t, slot)
        if m.group("rest").startswith(", new n_tokens"):
            debug.append(step)
        else:
            trace.append(step)
    return trace if trace else debug


def parse_draft_acceptance(log_text: str, task: Optional[int] = None) -> List[Dict[str, Any]]:
    """The per-request summary lines ``draft acceptance = r (A accepted / D generated)``."""
    out = []
    for m in _RE_ACCEPTANCE.finditer(log_text):
        if task is not None and int(m.group(2)) != task:
            continue
        out.append({"slot": int(m.group(1)), "task": int(m.group(2)), "ratio": float(m.group(3)),
                    "accepted": int(m.group(4)), "generated": int(m.group(5))})
    return out


# --------------------------------------------------------------------------------------------
# the server process
# --------------------------------------------------------------------------------------------

def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """A ``llama-server`` child process on 127.0.0.1, one slot, greedy by default.

    >>> with LlamaServer(ensure_llama_server(), target, draft) as srv:
    ...     out = srv.complete(prompt_tokens, 64)
    ...     out["tokens"], out["timings"]["draft_n"], out["steps"]

    Command line (all flags checked against common/arg.cpp of this commit)::

        llama-server -m MODEL --host 127.0.0.1 --port P -c CTX -np 1 -fa FA
                     --temp 0 --top-k 1 --seed SEED --no-webui -cram 0
                     [-t T -tb T] [-b B] [-ub UB]
                     [-md DRAFT --spec-type TYPE --spec-draft-n-max N [--spec-draft-p-min P]]
                     EXTRA_ARGS...

    ``LLAMA_TRACE=1`` is set in its environment (``trace=True``) so every verification step is
    logged; the log (stdout + stderr) goes to ``log_path`` or a temporary file.
    """

    def __init__(self, binary: PathLike, model: PathLike, draft: Optional[PathLike] = None, *,
                 spec_type: str = "draft-dspark", n_max: int = 7, p_min: Optional[float] = None,
                 ctx: int = 4096, threads: Optional[int] = None, extra_args: Iterable[str] = (),
                 port: Optional[int] = None, log_path: Optional[PathLike] = None,
                 env: Optional[Mapping[str, str]] = None, flash_attn: str = "auto",
                 n_batch: Optional[int] = None, n_ubatch: Optional[int] = None, seed: int = 0,
                 trace: bool = True, startup_timeout: float = 300.0,
                 request_timeout: float = 600.0) -> None:
        self.binary = Path(binary)
        self.model = Path(model)
        self.draft = Path(draft) if draft is not None else None
        if not self.binary.is_file():
            raise LlamaServerError(f"llama-server binary not found: {self.binary}")
        if not self.model.is_file():
            raise LlamaServerError(f"model not found: {self.model}")
        if self.draft is not None and not self.draft.is_file():
            raise LlamaServerError(f"draft model not found: {self.draft}")
        if flash_attn not in ("on", "off", "auto"):
            raise ValueError(f"flash_attn must be 'on', 'off' or 'auto', not {flash_attn!r}")
        if int(n_max) < 0:
            raise ValueError("n_max must be >= 0")
        self.spec_type = spec_type
        self.n_max = int(n_max)
        self.p_min = p_min
        self.ctx = int(ctx)
        self.threads = threads
        self.extra_args = [str(a) for a in extra_args]
        self.port = port
        self.flash_attn = flash_attn
        self.n_batch = n_batch
        self.n_ubatch = n_ubatch
        self.seed = int(seed)
        self.trace = trace
        self.startup_timeout = float(startup_timeout)
        self.request_timeout = float(request_timeout)
        self._env_extra = dict(env or {})
        self._log_path_arg = Path(log_path) if log_path is not None else None
        self.log_path: Optional[Path] = None
        self._tmpdir: Optional[tempfile.TemporaryDirectory] = None
        self._proc: Optional[subprocess.Popen] = None
        self._logf = None
        # never route 127.0.0.1 through an http_proxy from the environment
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> List[str]:
        """The argv used to start the server (port must be set)."""
        cmd = [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
               "-c", str(self.ctx), "-np", "1", "-fa", self.flash_attn,
               "--temp", "0", "--top-k", "1", "--seed", str(self.seed),
               "--no-webui", "-cram", "0"]
        if cpu_has_amx():
            # the same model loading as ours: llama.cpp's AMX repacking crashes with a draft's
            # capture on, and repacked weights would change the numerics (see pyllama_dspark.llama.amx)
            cmd += ["--no-repack"]
        if self.threads is not None:
            cmd += ["-t", str(int(self.threads)), "-tb", str(int(self.threads))]
        if self.n_batch is not None:
            cmd += ["-b", str(int(self.n_batch))]
        if self.n_ubatch is not None:
            cmd += ["-ub", str(int(self.n_ubatch))]
        if self.draft is not None:
            cmd += ["-md", str(self.draft), "--spec-type", self.spec_type, "--spec-draft-n-max", str(self.n_max)]
            if self.p_min is not None:
                cmd += ["--spec-draft-p-min", repr(float(self.p_min))]
        cmd += self.extra_args
        return cmd

    def start(self) -> "LlamaServer":
        if self.running:
            return self
        if self._log_path_arg is not None:
            self.log_path = self._log_path_arg
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        else:
            self._tmpdir = tempfile.TemporaryDirectory(prefix="llama-server-")
            self.log_path = Path(self._tmpdir.name) / "llama-server.log"
        env = dict(os.environ)
        if self.trace:
            env["LLAMA_TRACE"] = "1"
        env.update(self._env_extra)
        attempts = 1 if self.port is not None else 3
        fixed_port = self.port
        last_err: Optional[Exception] = None
        for _ in range(attempts):
            self.port = fixed_port if fixed_port is not None else _free_port()
            self._logf = open(self.log_path, "ab")
            cmd = self.command()
            self._logf.write(("$ " + " ".join(cmd) + "\n").encode())
            self._logf.flush()
            self._proc = subprocess.Popen(cmd, stdout=self._logf, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, start_new_session=True)
            try:
                self._wait_ready()
                return self
            except LlamaServerError as exc:
                last_err = exc
                self._shutdown()
                if "bind" not in str(exc).lower() and "address already in use" not in str(exc).lower():
                    break
        assert last_err is not None
        raise last_err

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            rc = self._proc.poll() if self._proc else -1
            if rc is not None:
                raise LlamaServerError(
                    f"llama-server exited with code {rc} during startup; log {self.log_path}:\n{self.log_tail()}")
            try:
                with self._opener.open(self.base_url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except urllib.error.HTTPError as exc:  # 503 while the model is loading
                if exc.code != 503:
                    raise LlamaServerError(f"/health answered {exc.code}: {exc.read()[:500]!r}") from exc
            except (urllib.error.URLError, ConnectionError, socket.timeout, OSError):
                pass
            time.sleep(0.2)
        raise LlamaServerError(
            f"llama-server not ready after {self.startup_timeout:.0f} s; log {self.log_path}:\n{self.log_tail()}")

    def _shutdown(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        if self._logf is not None:
            self._logf.close()
            self._logf = None

    def stop(self) -> None:
        """Terminate (then kill) the server. The log file is kept when ``log_path`` was given."""
        self._shutdown()
        if self._tmpdir is not None:
            self._keep_log_text = self.log_text()
            self._tmpdir.cleanup()
            self._tmpdir = None

    close = stop

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self._shutdown()
        except Exception:
            pass

    # -- log ---------------------------------------------------------------------------------

    def log_text(self, offset: int = 0) -> str:
        if self.log_path is None or not self.log_path.exists():
            return getattr(self, "_keep_log_text", "")[offset:]
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", errors="replace")

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size if self.log_path else 0
        except OSError:
            return 0

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    # -- HTTP --------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: Optional[dict] = None, timeout: Optional[float] = None) -> Any:
        if not self.running:
            raise LlamaServerError(f"llama-server is not running; log {self.log_path}:\n{self.log_tail()}")
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with self._opener.open(req, timeout=timeout or self.request_timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", errors="replace")[:2000]
            raise LlamaServerError(f"{method} {path} -> HTTP {exc.code}: {detail}") from exc
        except (urllib.error.URLError, ConnectionError, socket.timeout) as exc:
            raise LlamaServerError(f"{method} {path} failed: {exc}; log tail:\n{self.log_tail()}") from exc
        return json.loads(raw) if raw else None

    def health(self) -> dict:
        return self._request("GET", "/health")

    def props(self) -> dict:
        return self._request("GET", "/props")

    def complete(self, prompt_tokens: Sequence[int], n_predict: int, **sampling: Any) -> Dict[str, Any]:
        """Greedy completion of a token-id prompt through ``POST /completion``.

        The prompt is sent as a JSON array of ints: llama-server then uses it verbatim (no BOS is
        added, no re-tokenization: tools/server/server-common.cpp ``tokenize_input_subprompt``).
        ``cache_prompt`` is off (the whole prompt is evaluated, like a fresh context),
        ``return_tokens`` on. Generation stops at any end-of-generation token (``ignore_eos``
        defaults to false; the EOG token is the last element of ``tokens``) or after
        ``n_predict`` tokens. ``sampling`` entries override/extend the request body
        (``temperature`` 0 and ``top_k`` 1 by default).

        Returns ``{"tokens", "content", "timings", "stop_type", "stopping_word", "truncated",
        "steps", "acceptance", "log", "raw"}``; ``steps`` is the list of per-verification
        (n_drafted, n_accepted) from the log (needs ``trace=True``).
        """
        toks = [int(t) for t in prompt_tokens]
        if not toks:
            raise ValueError("prompt_tokens must not be empty")
        if any(t < 0 for t in toks):
            raise ValueError("prompt_tokens must be non-negative token ids")
        if int(n_predict) < 0 and int(n_predict) != -1:
            raise ValueError("n_predict must be >= 0 (or -1 for no limit)")
        body: Dict[str, Any] = {
            "prompt": toks,
            "n_predict": int(n_predict),
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
            "temperature": 0.0,
            "top_k": 1,
            "seed": self.seed,
        }
        body.update(sampling)
        offset = self._log_size()
        raw = self._request("POST", "/completion", body)
        log = self._wait_for_log(offset)
        tasks = [int(t) for t in re.findall(r"\| task (-?\d+) \|", log)]
        task = tasks[-1] if tasks else None
        return {
            "tokens": list(raw.get("tokens") or []),
            "content": raw.get("content", ""),
            "timings": raw.get("timings", {}),
            "stop_type": raw.get("stop_type"),
            "stopping_word": raw.get("stopping_word"),
            "truncated": raw.get("truncated"),
            "tokens_predicted": raw.get("tokens_predicted"),
            "tokens_evaluated": raw.get("tokens_evaluated"),
            "steps": parse_spec_steps(log, task),
            "acceptance": parse_draft_acceptance(log, task),
            "task": task,
            "log": log,
            "raw": raw,
        }

    def _wait_for_log(self, offset: int, timeout: float = 10.0) -> str:
        """Log written since ``offset``, once the slot has been released (logged after the reply)."""
        deadline = time.monotonic() + timeout
        text = self.log_text(offset)
        while "stop processing" not in text and time.monotonic() < deadline and self.running:
            time.sleep(0.05)
            text = self.log_text(offset)
        return text
