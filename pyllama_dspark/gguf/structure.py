"""The structural check of a GGUF file, before any parser sees it: the checks llama.cpp's own GGUF
reader makes (``ggml/src/gguf.cpp`` ``gguf_init_from_reader`` at our commit), in the same order,
plus what its model loader then assumes.

``gguf.GGUFReader`` (gguf-py) trusts the file: an array count of 2**62 or a string key retyped
as an array makes it parse garbage for minutes or run out of memory, and llama.cpp's mmap loader
aborts on a tensor whose data is not 32-byte aligned.  :func:`check_structure` walks the header,
every key/value and every tensor info with bounds checks (no allocation proportional to what the
file claims) and raises :class:`~pyllama_dspark.errors.ModelFileError` naming the first problem.
"""

from __future__ import annotations

import mmap
import struct
from typing import Dict, Tuple

from pyllama_dspark.errors import ModelFileError

__all__ = ["check_structure", "GGML_TYPE_SIZES", "TENSOR_ALIGNMENT"]

GGUF_MAX_STRING_LENGTH = 1024 * 1024 * 1024
GGUF_MAX_ARRAY_ELEMENTS = 1024 * 1024 * 1024
GGUF_DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64
TENSOR_ALIGNMENT = 32            # ggml's CPU buffer alignment: llama.cpp's mmap'd tensors must keep it
INT64_MAX = (1 << 63) - 1
# GGUF value types with a fixed size (8 STRING and 9 ARRAY are variable)
_VT_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _type_sizes() -> Dict[int, Tuple[int, int]]:
    """ggml type -> (block size, bytes per block), for the types gguf-py (our parser) knows."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(t): (int(b), int(s)) for t, (b, s) in GGML_QUANT_SIZES.items()}


GGML_TYPE_SIZES = _type_sizes()


class _Bad(Exception):
    pass


def check_structure(path: str, size: int) -> None:
    """Raise ModelFileError unless ``path`` (``size`` bytes, magic already checked) is a GGUF file
    llama.cpp's reader accepts, with every tensor's data inside the file and 32-byte aligned."""
    try:
        with open(path, "rb") as fh:
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                _check(mm, size)
    except _Bad as e:
        raise ModelFileError(f"truncated or corrupt GGUF file {path!r}: {e}") from None
    except _Truncated as e:
        raise ModelFileError(f"truncated GGUF file {path!r}: {e}") from None
    except (OSError, ValueError) as e:
        raise ModelFileError(f"cannot read model file {path!r}: {e}") from e


class _Truncated(Exception):
    pass


def _check(mm, size: int) -> None:
    p = 4

    def take(n: int, what: str) -> int:
        nonlocal p
        if n > size - p:
            raise _Truncated(f"{what} needs {n} bytes at offset {p}, the file has {size - p} left")
        at = p
        p += n
        return at

    def u32(what: str) -> int:
        return struct.unpack_from("<I", mm, take(4, what))[0]

    def u64(what: str) -> int:
        return struct.unpack_from("<Q", mm, take(8, what))[0]

    def string(what: str) -> bytes:
        n = u64(what + " length")
        if n > GGUF_MAX_STRING_LENGTH:
            raise _Bad(f"{what} length {n} exceeds the maximum {GGUF_MAX_STRING_LENGTH}")
        at = take(n, what)
        return mm[at:at + n]

    version = u32("the version")
    if version & 0x0000FFFF == 0:
        raise _Bad(f"GGUF version {version:#x} is extremely large (a big-endian file?)")
    if version == 1:
        raise _Bad("GGUFv1 is no longer supported")
    if version not in (2, 3):
        raise _Bad(f"unsupported GGUF version {version} (llama.cpp reads 2 and 3)")
    n_tensors = u64("the tensor count")
    n_kv = u64("the key/value count")
    # each key/value takes >= 13 bytes (key length, a 1-byte key, type), each tensor info >= 25
    if n_kv > INT64_MAX or 13 * n_kv > size - p:
        raise _Bad(f"key/value count {n_kv} cannot fit in the file")
    if n_tensors > INT64_MAX or 25 * n_tensors > size - p:
        raise _Bad(f"tensor count {n_tensors} cannot fit in the file")

    keys = set()
    alignment = GGUF_DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = string(f"key #{i}")
        if not key:
            raise _Bad(f"key #{i} is empty")
        name = key.decode("utf-8", "replace")
        if key in keys:
            raise _Bad(f"duplicate key {name!r}")
        keys.add(key)
        vt = u32(f"the type of {name!r}")
        if vt == 9:
            at = u32(f"the element type of {name!r}")
            n = u64(f"the element count of {name!r}")
            if at == 9 or (at != 8 and at not in _VT_SIZE):
                raise _Bad(f"key {name!r} is an array of invalid GGUF type {at}")
            if n > GGUF_MAX_ARRAY_ELEMENTS:
                raise _Bad(f"key {name!r} has {n} elements, more than the maximum {GGUF_MAX_ARRAY_ELEMENTS}")
            if at == 8:
                if 8 * n > size - p:
                    raise _Truncated(f"the {n} strings of {name!r} cannot fit in the file")
                for j in range(n):
                    string(f"{name}[{j}]")
            else:
                take(_VT_SIZE[at] * n, f"the {n} values of {name!r}")
        elif vt == 8:
            string(f"the value of {name!r}")
        elif vt in _VT_SIZE:
            at = take(_VT_SIZE[vt], f"the value of {name!r}")
            if key == b"general.alignment":
                if vt != 4:
                    raise _Bad(f"key 'general.alignment' must be of type UINT32, is type {vt}")
                alignment = struct.unpack_from("<I", mm, at)[0]
                if alignment == 0 or alignment & (alignment - 1):
                    raise _Bad(f"alignment {alignment} is not a power of 2")
        else:
            raise _Bad(f"key {name!r} has invalid GGUF type {vt}")

    names = set()
    infos = []
    for i in range(n_tensors):
        raw = string(f"the name of tensor #{i}")
        name = raw.decode("utf-8", "replace")
        if len(raw) >= GGML_MAX_NAME:
            raise _Bad(f"tensor name #{i} is too long: {len(raw)} >= {GGML_MAX_NAME}")
        if raw in names:
            raise _Bad(f"duplicate tensor name {name!r}")
        names.add(raw)
        n_dims = u32(f"the dimension count of {name!r}")
        if n_dims > GGML_MAX_DIMS:
            raise _Bad(f"tensor {name!r} has {n_dims} dimensions, more than {GGML_MAX_DIMS}")
        ne = [u64(f"the shape of {name!r}") for _ in range(n_dims)]
        n_el = 1
        for d in ne:
            if d > INT64_MAX:
                raise _Bad(f"tensor {name!r} has a negative dimension")
            n_el *= d
        if n_el > INT64_MAX:
            raise _Bad(f"tensor {name!r} shape {ne} has more than INT64_MAX elements")
        gtype = u32(f"the type of {name!r}")
        if gtype not in GGML_TYPE_SIZES:
            raise _Bad(f"tensor {name!r} has invalid or unsupported ggml type {gtype}")
        blck, tsize = GGML_TYPE_SIZES[gtype]
        if (ne[0] if ne else 1) % blck:
            raise _Bad(f"tensor {name!r} of ggml type {gtype} has {ne[0] if ne else 1} elements per row, "
                       f"not a multiple of the block size {blck}")
        offset = u64(f"the data offset of {name!r}")
        infos.append((name, offset, n_el // blck * tsize))

    if not infos:
        return
    data_start = (p + alignment - 1) // alignment * alignment
    if data_start > size:
        raise _Truncated("the tensor data section starts past the end of the file")
    expected = 0
    for name, offset, nbytes in infos:
        if offset != expected:
            raise _Bad(f"tensor {name!r} has data offset {offset}, expected {expected}")
        if (data_start + offset) % TENSOR_ALIGNMENT:
            raise _Bad(f"tensor {name!r} data at file offset {data_start + offset} is not "
                       f"{TENSOR_ALIGNMENT}-byte aligned (general.alignment {alignment})")
        if data_start + offset + nbytes > size:
            raise _Truncated(f"tensor {name!r} needs {data_start + offset + nbytes} bytes, the file has {size}")
        expected += (nbytes + alignment - 1) // alignment * alignment
