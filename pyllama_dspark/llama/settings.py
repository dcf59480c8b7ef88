"""What a model and its context are opened with: llama.cpp's context parameters, the offload
(``n_gpu_layers``, RPC servers, tensor split) and the draft's offload."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple, Union

from llama_cpp import llama_cpp as ll

from pyllama_dspark.llama import rpc
from pyllama_dspark.llama.backend import default_threads
from pyllama_dspark.llama.backend_sampling import check_mode as check_backend_sampling, readout_kind
from pyllama_dspark.llama.offload import ALL_LAYERS, parse_n_gpu_layers

#: output rows per sequence and decode that backend sampling is set up for (llama/backend_sampling.py)
BACKEND_SAMPLING_ROWS = 64

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
    # llama.cpp's -ngl: a count, "auto" (llama.cpp's default: every layer on the GPU when it fits,
    # none without a GPU) or "all"; resolved when the model is loaded (llama/offload.py)
    n_gpu_layers: Union[int, str] = "auto"
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
    n_gpu_layers_draft: Optional[Union[int, str]] = None
    # what n_gpu_layers resolved to when the model was loaded (set by the loader, not by users):
    # a count, or -1 for every layer
    n_gpu_layers_resolved: Optional[int] = None
    # llama.cpp's -bs / --spec-draft-backend-sampling: greedy rows read out on the device (their
    # top 2, no logits row copied; llama/backend_sampling.py): "auto" (on when offloaded), "on", "off"
    backend_sampling: str = "auto"
    # llama.cpp's n_rs_seq: recurrent-state snapshots per sequence, how far back a hybrid target's
    # recurrent state can be cut (0: none; set for the target from the draft's block, llama/recurrent.py)
    n_rs_seq: int = 0

    def validate(self) -> None:
        if self.flash_attn not in _FLASH_ATTN:
            raise ValueError(f"flash_attn must be one of {sorted(_FLASH_ATTN)}, got {self.flash_attn!r}")
        for name in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be > 0")
        check_backend_sampling(self.backend_sampling)
        if self.backend_sampling != "off":
            readout_kind()   # a bad $PYLLAMA_DSPARK_DEVICE_READOUT is refused before a load
        self.n_gpu_layers = parse_n_gpu_layers(self.n_gpu_layers)
        if self.n_gpu_layers_draft is not None:
            self.n_gpu_layers_draft = parse_n_gpu_layers(self.n_gpu_layers_draft)
        if self.n_ubatch > self.n_batch:
            self.n_ubatch = self.n_batch
        self.rpc = rpc.parse_endpoints(self.rpc if self.rpc else None)
        split = tuple(float(x) for x in (self.tensor_split or ()))
        if len(split) > int(ll.llama_max_devices()) or any(not x >= 0 for x in split) or (split and sum(split) <= 0):
            raise ValueError(f"tensor_split must be at most {int(ll.llama_max_devices())} non-negative "
                             f"proportions with a positive sum, got {list(split)}")
        self.tensor_split = split

    @property
    def offloaded(self) -> bool:
        """Whether the loaded model has layers on an offload device (GPU or RPC)."""
        n = self.n_gpu_layers_resolved if self.n_gpu_layers_resolved is not None else self.n_gpu_layers
        return isinstance(n, int) and (n > 0 or n == ALL_LAYERS)

    @property
    def device_readout(self) -> bool:
        """Whether greedy rows are read out on the device (backend_sampling, resolved)."""
        return self.backend_sampling == "on" or (self.backend_sampling == "auto" and self.offloaded)

    def placement(self):
        """Where the layers go, for cache keys: the resolved n_gpu_layers (as requested before a
        load), plus the RPC servers and split if any."""
        n = self.n_gpu_layers_resolved if self.n_gpu_layers_resolved is not None else self.n_gpu_layers
        if not self.rpc and not self.tensor_split:
            return n
        return [n, list(self.rpc), list(self.tensor_split)]

    def for_draft(self) -> "ContextSettings":
        """These settings with the draft's offload (-ngld, else -ngl as requested) as n_gpu_layers:
        an ``auto`` is resolved for the draft's own file."""
        ngl = self.n_gpu_layers if self.n_gpu_layers_draft is None else self.n_gpu_layers_draft
        return dataclasses.replace(self, n_gpu_layers=ngl, n_gpu_layers_draft=None, n_gpu_layers_resolved=None,
                                   n_rs_seq=0)

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
        p.n_rs_seq = int(self.n_rs_seq)   # clamped to 0 by llama.cpp for an arch without snapshots
        if self.device_readout:
            # a sequence with a backend sampler may have at most this many output rows a decode
            # (llama.cpp's default is 1): a verify block, a draft block, the cost curve's 32 rows
            p.n_outputs_max_per_seq = BACKEND_SAMPLING_ROWS
        return p
