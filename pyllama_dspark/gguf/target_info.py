"""What a target GGUF says about the parts a DFlash/DSpark draft depends on: hyper-parameters,
vocabulary, tokenizer fingerprint, and whether its llama.cpp graph can expose layer inputs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from pyllama_dspark.errors import ModelFileError, UnsupportedArchError
from pyllama_dspark.gguf.layer_inputs import (FINAL_LAYER_INPUT_ARCHS, HYBRID_ARCHS, LAYER_INPUT_ARCHS,
                                             unsupported_arch_message)
from pyllama_dspark.gguf.hparams import check_hparams, check_tensor_types
from pyllama_dspark.gguf.reader import (cached_info, check_path, field_value, n_tokens, read_gguf, scalar_field,
                                        tokenizer_fingerprint)

__all__ = ["TargetInfo", "read_target_info"]


@dataclass(frozen=True)
class TargetInfo:
    """What a target GGUF says about the parts a draft depends on."""

    path: str
    arch: str
    n_embd: int
    n_layer: int             # llama_model_n_layer: block_count - nextn_predict_layers
    n_layer_all: int         # block_count
    n_vocab: int             # tokenizer size
    n_ctx_train: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rope_freq_base: float
    rms_eps: float
    tokenizer_model: str
    tokenizer_pre: str
    tokenizer_fingerprint: str
    supports_layer_inputs: bool     # arch in LAYER_INPUT_ARCHS
    accepts_final_layer_id: bool    # id == n_layer is filled (deepseek4, mimo2, nemotron-h)
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None

    @property
    def hybrid(self) -> bool:
        """Whether the memory holds a recurrent state beside the attention cache (layer_inputs.HYBRID_ARCHS)."""
        return self.arch in HYBRID_ARCHS

    @property
    def max_layer_id(self) -> int:
        """Largest layer-input id that can be enabled on this target without an abort."""
        return self.n_layer if self.accepts_final_layer_id else self.n_layer - 1

    @property
    def valid_layer_ids(self) -> range:
        return range(0, self.max_layer_id + 1)


def read_target_info(path, *, require_layer_inputs: bool = True, use_cache: bool = True) -> TargetInfo:
    """Read the target GGUF's hyper-parameters, vocabulary and tokenizer fingerprint.

    With ``require_layer_inputs`` (the default) an architecture whose graph cannot expose layer
    inputs raises :class:`UnsupportedArchError`; pass ``False`` to just inspect such a model.
    """
    path = check_path(path)
    info = cached_info("target", path, use_cache, lambda: _parse_target_info(path, use_cache), TargetInfo)
    if require_layer_inputs and not info.supports_layer_inputs:
        raise UnsupportedArchError(unsupported_arch_message(info.arch, os.path.basename(info.path)))
    return info


def _parse_target_info(path: str, use_cache: bool) -> TargetInfo:
    r = read_gguf(path, use_cache=use_cache)
    name = os.path.basename(path)
    arch = field_value(r, "general.architecture", None)
    if not isinstance(arch, str) or not arch:
        raise ModelFileError(f"{name}: GGUF has no general.architecture")
    a = arch
    check_hparams(r, a, name)
    check_tensor_types(r, name)
    n_embd = field_value(r, f"{a}.embedding_length", None)
    n_layer_all = field_value(r, f"{a}.block_count", None)
    if n_embd is None or n_layer_all is None:
        raise ModelFileError(f"{name}: GGUF lacks {a}.embedding_length / {a}.block_count")
    n_nextn = int(field_value(r, f"{a}.nextn_predict_layers", 0) or 0)
    n_head = scalar_field(r, f"{a}.attention.head_count", 0)
    n_vocab = n_tokens(r)
    if n_vocab <= 0:
        raise ModelFileError(f"{name}: GGUF has no tokenizer (tokenizer.ggml.tokens)")
    tok_model = field_value(r, "tokenizer.ggml.model", "")
    tok_pre = field_value(r, "tokenizer.ggml.pre", "")
    bos = field_value(r, "tokenizer.ggml.bos_token_id", None)
    eos = field_value(r, "tokenizer.ggml.eos_token_id", None)
    return TargetInfo(
        path=path,
        arch=arch,
        n_embd=int(n_embd),
        n_layer=int(n_layer_all) - n_nextn,
        n_layer_all=int(n_layer_all),
        n_vocab=n_vocab,
        n_ctx_train=int(scalar_field(r, f"{a}.context_length", 0) or 0),
        n_head=int(n_head or 0),
        n_head_kv=int(scalar_field(r, f"{a}.attention.head_count_kv", n_head) or 0),
        head_dim=int(scalar_field(r, f"{a}.attention.key_length",
                                  (int(n_embd) // n_head) if n_head else 0) or 0),
        n_ff=int(scalar_field(r, f"{a}.feed_forward_length", 0) or 0),
        rope_freq_base=float(scalar_field(r, f"{a}.rope.freq_base", 10000.0, kind=float)),
        rms_eps=float(scalar_field(r, f"{a}.attention.layer_norm_rms_epsilon", 0.0, kind=float)),
        tokenizer_model=tok_model if isinstance(tok_model, str) else repr(tok_model),
        tokenizer_pre=tok_pre if isinstance(tok_pre, str) else repr(tok_pre),
        tokenizer_fingerprint=tokenizer_fingerprint(r),
        supports_layer_inputs=arch in LAYER_INPUT_ARCHS,
        accepts_final_layer_id=arch in FINAL_LAYER_INPUT_ARCHS,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
    )
