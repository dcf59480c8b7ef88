"""``llama-server`` built on the libraries the installed llama-cpp-python already compiled.

A pip install of llama-cpp-python builds libggml, libllama, libmtmd and libllama-common from its
vendored llama.cpp and installs them (``site-packages/lib``).  llama-server is then only its own
``tools/server`` sources (about 15 compile units against ~200 for the whole tree): they are
compiled against the same headers and linked to those libraries (RPATH to them), so the server
runs exactly the kernels our Python side runs.  When the libraries are not there or the build
fails, :mod:`.llama_server_build` builds the whole tree instead.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import List, Optional

LIBS = ("libllama-common.so", "libmtmd.so", "libllama.so", "libggml.so", "libggml-base.so")

# the server target of llama.cpp's tools/server/CMakeLists.txt, its include paths and the public
# compile definitions llama-common and cpp-httplib give their users (LLAMA_SUBPROCESS is on for
# every desktop OS; CPPHTTPLIB_OPENSSL_SUPPORT when llama-common was built with OpenSSL)
CMAKELISTS = r"""
cmake_minimum_required(VERSION 3.14)
project(llama_server_linked C CXX)
set(CMAKE_CXX_STANDARD 17)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
if (NOT CMAKE_BUILD_TYPE)
    set(CMAKE_BUILD_TYPE Release)
endif()
find_package(Threads REQUIRED)

set(SRC ${LLAMA_SRC})
set(S ${SRC}/tools/server)
set(UI_DIR ${CMAKE_BINARY_DIR}/ui)
# the Web UI stub llama.cpp generates when the UI is not built (no download)
execute_process(COMMAND ${CMAKE_COMMAND}
    "-DUI_SOURCE_DIR=${SRC}/tools/ui" "-DUI_BINARY_DIR=${UI_DIR}" "-DLLAMA_SOURCE_DIR=${SRC}"
    "-DLLAMA_BUILD_NUMBER=" "-DHF_BUCKET=none" "-DHF_VERSION=" "-DHF_ENABLED=OFF" "-DBUILD_UI=OFF"
    "-DLLAMA_UI_GZIP=ON" -P "${SRC}/scripts/ui-assets.cmake"
    RESULT_VARIABLE ui_rc)
if (NOT ui_rc EQUAL 0)
    message(FATAL_ERROR "generating the UI stub failed: ${ui_rc}")
endif()

add_executable(llama-server
    ${S}/main.cpp ${S}/server.cpp ${S}/server-http.cpp ${S}/server-models.cpp
    ${S}/server-chat.cpp ${S}/server-task.cpp ${S}/server-queue.cpp ${S}/server-common.cpp
    ${S}/server-context.cpp ${S}/server-stream.cpp ${S}/server-tools.cpp ${S}/server-mcp.cpp
    ${S}/server-schema.cpp ${UI_DIR}/ui.cpp ${CMAKE_CURRENT_SOURCE_DIR}/preload_backends.cpp)
target_include_directories(llama-server PRIVATE ${S} ${UI_DIR} ${SRC}/tools/mtmd ${SRC} ${SRC}/common
    ${SRC}/include ${SRC}/ggml/include ${SRC}/vendor)
target_compile_definitions(llama-server PRIVATE LLAMA_SUBPROCESS ${EXTRA_DEFINES})
target_link_libraries(llama-server PRIVATE
    ${LLAMA_LIB}/libllama-common.so ${LLAMA_LIB}/libmtmd.so ${LLAMA_LIB}/libllama.so
    ${LLAMA_LIB}/libggml.so ${LLAMA_LIB}/libggml-base.so Threads::Threads ${EXTRA_LIBS})
set_target_properties(llama-server PROPERTIES BUILD_RPATH "${LLAMA_LIB}")
"""

# llama-server's --rpc asks llama_supports_rpc(), which loads the backends found next to the
# executable only when none is registered yet: true in a GGML_BACKEND_DL build, never here, where
# the installed libggml registers its CPU backend at start.  Loading them at start, as that build
# would, lets the RPC module that :mod:`.rpc_build` puts beside this binary be found.
PRELOAD = """// the backends beside the executable (llama.cpp's RPC module), loaded before main() as a
// GGML_BACKEND_DL build of llama.cpp would load them
#include "ggml-backend.h"
namespace {
struct preload_backends { preload_backends() { ggml_backend_load_all(); } } preload_at_start;
}
"""
# written into build-info.json: a cached llama-server without it is rebuilt by the RPC build
FEATURES = ("preload_backends",)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def installed_lib_dir() -> Optional[Path]:
    """The folder with llama-cpp-python's installed llama.cpp libraries, if they are all there and
    its libllama is the very file llama-cpp-python loads (the same build), else None."""
    try:
        import llama_cpp
    except ImportError:
        return None
    pkg = Path(llama_cpp.__file__).resolve().parent
    lib = pkg.parent / "lib"
    if not all((lib / name).exists() for name in LIBS):
        return None
    loaded = pkg / "lib" / "libllama.so"
    if loaded.exists() and _digest(loaded.resolve()) != _digest((lib / "libllama.so").resolve()):
        return None
    return lib


def configure_command(cmake: str, ninja: Optional[str], src: Path, project: Path, build: Path,
                      lib: Path) -> List[str]:
    """Writes the CMake project into ``project`` and returns its configure command line."""
    project.mkdir(parents=True, exist_ok=True)
    (project / "CMakeLists.txt").write_text(CMAKELISTS)
    (project / "preload_backends.cpp").write_text(PRELOAD)
    ssl = b"libssl.so" in (lib / "libllama-common.so").resolve().read_bytes()
    cmd = [cmake, "-S", str(project), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
           f"-DLLAMA_SRC={src}", f"-DLLAMA_LIB={lib}"]
    if ssl:
        cmd += ["-DEXTRA_DEFINES=CPPHTTPLIB_OPENSSL_SUPPORT", "-DEXTRA_LIBS=ssl;crypto"]
    if ninja:
        cmd += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    return cmd
