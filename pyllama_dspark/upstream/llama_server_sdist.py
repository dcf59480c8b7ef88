"""The llama.cpp sources ``llama-server`` is built from (:mod:`.llama_server_build`): the
``vendor/llama.cpp`` of the llama-cpp-python sdist of the *installed* version (the very commit of
the libllama that llama-cpp-python loads), found locally or downloaded, and extracted into the cache.

Only the standard library is used (``urllib`` and ``pip download`` for the sdist).

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

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import List, Optional, Tuple, Union

from pyllama_dspark.errors import DSparkError

PathLike = Union[str, "os.PathLike[str]"]

ENV_CACHE = "PYLLAMA_DSPARK_CACHE"
ENV_SDIST = "PYLLAMA_DSPARK_SDIST"          # path of a local llama-cpp-python sdist (skips the download)


class LlamaServerBuildError(DSparkError, RuntimeError):
    """llama-server could not be built (missing tool, download or compile failure)."""


def log_progress(msg: str) -> None:
    print(f"[pyllama-dspark] {msg}", file=sys.stderr, flush=True)


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
    log_progress("downloading the llama-cpp-python sdist: " + " ".join(cmd[1:]))
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode == 0:
        found = sorted(dest_dir.glob(f"llama_cpp_python-{version}.tar.gz")) + sorted(
            dest_dir.glob(f"llama-cpp-python-{version}.tar.gz"))
        if found:
            return found[0]
        errors.append("pip download succeeded but left no sdist")
    else:
        errors.append(f"pip download (rc={proc.returncode}): {proc.stderr.strip()[-1500:]}")
    log_progress("pip download failed; trying the PyPI JSON API")
    try:
        url, filename, sha256 = _pypi_sdist_url(version)
        target = dest_dir / filename
        tmp = dest_dir / (filename + f".part-{os.getpid()}")
        log_progress(f"downloading {url}")
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


def locate_sdist(version: str, root: Path, sdist: Optional[PathLike]) -> Path:
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


def extract_llama_cpp(sdist: Path, dest: Path) -> None:
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
