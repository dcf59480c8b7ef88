"""The shim's ctypes module for the sampling code, loaded on first use: the sampler chain, top-k and
inverse-CDF draws run there when it is loaded, and the numpy paths keep working when it is not."""

from __future__ import annotations

_nat = None


def native():
    """The shim's ctypes module, or False when it cannot be loaded (the numpy paths stay usable)."""
    global _nat
    if _nat is None:
        try:
            from pyllama_dspark.llama import _native as n

            _nat = n
        except Exception:  # the pure-numpy fallbacks keep sampling usable without the shim
            _nat = False
    return _nat


def native_chain():
    """The shim's ctypes module when it has the C sampler chain, else False."""
    n = native()
    return n if n and n.chain_dist is not None and n.chain_dense is not None else False
