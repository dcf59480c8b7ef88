"""pyllama-dspark: DSpark speculative decoding for llama.cpp, driven from Python.

Heavy modules (ctypes, llama.cpp) load lazily: ``from pyllama_dspark import Speculator``.
"""

__version__ = "0.1.0"

from pyllama_dspark.errors import (  # noqa: F401
    ClosedError, ContextOverflowError, DraftMismatchError, DSparkError, ModelFileError, NativeError,
    UnsupportedArchError,
)

from pyllama_dspark.llama.amx import cpu_has_amx as _cpu_has_amx  # noqa: E402

if _cpu_has_amx():   # llama.cpp's AMX repacking crashes with a draft's capture: load models without it
    from pyllama_dspark.llama.amx import install as _install_amx

    _install_amx()


def _rpc_module():  # llama.cpp's RPC backend module, built and cached on first use of --rpc
    from pyllama_dspark.upstream.rpc_build import rpc_module
    return rpc_module()


from pyllama_dspark.llama import rpc as _rpc  # noqa: E402

_rpc.set_module_provider(_rpc_module)


def __getattr__(name):
    if name == "Speculator":
        from pyllama_dspark.decode.api import Speculator
        return Speculator
    if name == "DSpark":
        from pyllama_dspark.integrations.dspark import DSpark
        return DSpark
    if name in ("DSparkDraftModel", "attach_dspark"):
        from pyllama_dspark.integrations import llama_plugin
        return getattr(llama_plugin, name)
    if name == "SpecDecoder":
        from pyllama_dspark.decode.engine import SpecDecoder
        return SpecDecoder
    if name in ("Stats", "Chunk", "Done"):
        from pyllama_dspark.decode import cycle
        return getattr(cycle, name)
    raise AttributeError(name)
