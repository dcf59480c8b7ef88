"""What a model and its context are opened with: llama.cpp's context parameters, the offload
(``n_gpu_layers``, RPC servers, tensor split) and the draft's offload."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

from llama_cpp import llama_cpp as ll

from pyllama_dspark.llama import rpc
from pyllama_dspark.llama.backend import default_threads

_FLASH_ATTN = {
    "auto": ll.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": ll.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": ll.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}


@dataclass
class ContextSettings:
    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: Optional[int] = None
    n_threads_batch: Optional[int] = None
    flash_attn: str = "auto"
    n_seq_max: int = 1
    n_gpu_layers: int = 0
    verbose: bool = False
    # full-size SWA caches (llama-server's --swa-full, off by default there).  Off: the SWA KV
    # cache holds n_swa + n_ubatch cells and a new batch only overwrites cells masked for its
    # first position, so removing a rejected draft tail (always inside the last batch) is safe
    swa_full: bool = False
    # one KV buffer for all sequences (llama-server's -kvu): any one sequence may use all of n_ctx
    kv_unified: bool = False
    # llama-server's --rpc: the model's offloaded layers (n_gpu_layers) go to these RPC servers
    rpc: Tuple[str, ...] = ()
    # llama-server's -ts: the share of the offloaded layers each device gets (RPC devices first)
    tensor_split: Tuple[float, ...] = ()
    # llama-server's -ngld: the draft's offloaded layers (None: as n_gpu_layers)
    n_gpu_layers_draft: Optional[int] = None

    def validate(self) -> None:
        if self.flash_attn not in _FLASH_ATTN:
            raise ValueError(f"flash_attn must be one of {sorted(_FLASH_ATTN)}, got {self.flash_attn!r}")
        for name in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.n_ubatch > self.n_batch:
            self.n_ubatch = self.n_batch
        self.rpc = rpc.parse_endpoints(self.rpc if self.rpc else None)
        split = tuple(float(x) for x in (self.tensor_split or ()))
        if len(split) > int(ll.llama_max_devices()) or any(not x >= 0 for x in split) or (split and sum(split) <= 0):
            raise ValueError(f"tensor_split must be at most {int(ll.llama_max_devices())} non-negative "
                             f"proportions with a positive sum, got {list(split)}")
        self.tensor_split = split

    def placement(self):
        """Where the layers go, for cache keys: n_gpu_layers, plus the RPC servers and split if any."""
        if not self.rpc and not self.tensor_split:
            return self.n_gpu_layers
        return [self.n_gpu_layers, list(self.rpc), list(self.tensor_split)]

    def for_draft(self) -> "ContextSettings":
        """These settings with the draft's offload (-ngld) as n_gpu_layers."""
        if self.n_gpu_layers_draft is None:
            return self
        return dataclasses.replace(self, n_gpu_layers=int(self.n_gpu_layers_draft), n_gpu_layers_draft=None)

    def context_params(self):
        p = ll.llama_context_default_params()
        p.n_ctx = self.n_ctx
        p.n_batch = self.n_batch
        p.n_ubatch = self.n_ubatch
        p.n_seq_max = self.n_seq_max
        threads = self.n_threads or default_threads()
        p.n_threads = threads
        p.n_threads_batch = self.n_threads_batch or threads
        p.flash_attn_type = _FLASH_ATTN[self.flash_attn]
        p.swa_full = bool(self.swa_full)
        p.kv_unified = bool(self.kv_unified)
        p.no_perf = True
        return p
