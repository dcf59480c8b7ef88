"""Weight types of the random test drafts (``make-test-draft --type``, ``-md random:TYPE``,
``-md oracle:P:TYPE``): which GGUF type each tensor gets, as llama.cpp's own tools would write it.

Released DSpark/DFlash drafters are BF16 checkpoints; a llama.cpp user converts them with
``convert_hf_to_gguf.py --outtype bf16|f16|q8_0|f32`` (or ``auto``), and for Q4_0 quantizes that
file with ``llama-quantize``.  :func:`draft_tensor_type` gives, per tensor, the type those tools
choose (vendored llama.cpp: ``conversion/base.py`` ``prepare_tensors``, ``src/llama-quant.cpp``
``tensor_allows_quantization`` / ``tensor_type_fallback``):

* 1-D tensors, ``*_norm.weight`` and every tensor whose name does not end in ``.weight``
  (``conf_proj.bias``, ``*.scale``): F32;
* every other matrix: the type asked for;
* Q8_0 / Q4_0 need rows (ggml ``ne[0]``, numpy ``shape[-1]``) that are a multiple of 32; a matrix
  whose rows are not falls back to F16, as both tools do (the converter on its ``QuantError``,
  ``llama-quantize`` in ``tensor_type_fallback``);
* ``q4_0`` is ``llama-quantize Q4_0`` of the BF16 conversion: it leaves tensors with one row
  (ggml ``n_dims`` 1: ``conf_proj.weight``, ``[1, d + rank]``) as they were, i.e. BF16;
* one deviation, for hazard 9 (DESIGN.md): ``fc.weight`` is never F16.  On the CPU ggml converts
  the activations of an F16 matrix product to F16, and the target's layer inputs that ``fc``
  projects overflow its range (65504) to inf.  Where the rules above say F16 for ``fc`` (``--type
  f16``, or a Q8_0 / Q4_0 fallback) it is F32, which is also what ``convert`` keeps it in.  BF16,
  Q8_0 and Q4_0 (activations in F32 / Q8_0 blocks with an F32 scale) are safe and are kept.

Except at ``f32``, the random weights are rounded to BF16 first, as a released checkpoint's are:
so the ``q4_0`` draft is, byte for byte, what ``llama-quantize`` makes of the ``bf16`` one.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["DRAFT_TYPES", "DEFAULT_DRAFT_TYPE", "draft_tensor_type", "draft_file_type", "check_draft_type"]

#: ``--type`` values of the test drafts; the default first
DRAFT_TYPES = ("bf16", "f32", "f16", "q8_0", "q4_0")
#: what released drafters are, and what ``make-test-draft`` / ``-md random`` / ``-md oracle:P`` write
DEFAULT_DRAFT_TYPE = "bf16"

_BLOCK = 32          # QK8_0 == QK4_0


def check_draft_type(weight_type) -> str:
    """``weight_type`` lower-cased, or ValueError naming the valid ones."""
    wt = str(weight_type).lower()
    if wt not in DRAFT_TYPES:
        raise ValueError(f"draft weight type must be one of {', '.join(DRAFT_TYPES)}, got {weight_type!r}")
    return wt


def draft_tensor_type(name: str, shape: Sequence[int], weight_type: str) -> str:
    """The encoding (:data:`pyllama_dspark.gguf.write.TENSOR_ENCODINGS`) of tensor ``name`` with
    numpy ``shape`` in a test draft of ``weight_type`` (the rules in the module docstring)."""
    wt = check_draft_type(weight_type)
    shape = tuple(int(x) for x in shape)
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return "f32"
    if wt == "q4_0" and all(x == 1 for x in shape[:-1]):
        return "bf16"                     # llama-quantize leaves one-row tensors as converted
    if wt in ("q8_0", "q4_0") and shape[-1] % _BLOCK:
        wt = "f16"
    if name == "fc.weight" and wt == "f16":
        return "f32"                      # hazard 9
    return wt


def draft_file_type(weight_type: str) -> int:
    """``general.file_type`` (llama_ftype) of a test draft of ``weight_type``, as llama.cpp's
    converter / quantizer set it."""
    import gguf

    ft = gguf.LlamaFileType
    return int({"f32": ft.ALL_F32, "f16": ft.MOSTLY_F16, "bf16": ft.MOSTLY_BF16, "q8_0": ft.MOSTLY_Q8_0,
                "q4_0": ft.MOSTLY_Q4_0}[check_draft_type(weight_type)])
