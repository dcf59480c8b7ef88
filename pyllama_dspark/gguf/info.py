"""Reading and checking GGUF metadata of DFlash/DSpark drafts and their targets.

Everything llama.cpp would turn into an abort (GGML_ASSERT / GGML_ABORT kills the whole
process) when a draft does not fit its target is checked here first, from the GGUF metadata
alone, and raised as a Python exception instead (see DESIGN.md, "Known hazards").

The facts below were read from the llama.cpp sources vendored in llama-cpp-python 0.3.36
(``vendor/llama.cpp``); file:line references are to that tree.

Target layer ids
----------------
``dflash.target_layers`` is stored by the converter as ``HF target_layer_ids + 1``
(conversion/qwen.py:735-738): HF index ``i`` names the *output* of decoder layer ``i``, which is
the *input* of llama.cpp layer ``i + 1``.  llama.cpp then uses the stored numbers verbatim:

* src/models/dflash.cpp:37 reads the array straight into ``llama_model::target_layer_ids``;
* src/llama-model.cpp:3443-3449 ``llama_model_target_layer_ids[_n]`` return that vector as is;
* common/speculative.cpp:1057-1058 passes each value unchanged to
  ``llama_set_embeddings_layer_inp(ctx_tgt, id, true)`` and, :1153-1154, to
  ``llama_get_embeddings_layer_inp``;
* layer-input id ``lid`` is the tensor the target graph stores in ``res->t_layer_inp[lid]``,
  i.e. the input of 0-based layer ``lid`` (``lid == 0``: the token embeddings), e.g.
  src/models/llama.cpp:127 / src/models/qwen3.cpp:72 (``res->t_layer_inp[il] = inpL`` at the top
  of layer ``il``).

So :attr:`DraftInfo.target_layers_raw` (what the file holds) and :attr:`DraftInfo.target_layer_ids`
(what to pass to ``llama_set_embeddings_layer_inp``) are the same numbers; both are exposed so
callers never have to guess, and :attr:`DraftInfo.target_layers_hf` gives the HF (0-based
"hidden state of layer i") view, ``raw - 1``.

Valid ids: ``llama_context`` sizes the capture flags as ``n_layer() + 1``
(src/llama-context.cpp:126) and ``set_embeddings_layer_inp`` asserts ``lid <= n_layer()``
(src/llama-context.cpp:1240), so an id above ``n_layer`` aborts at once (hazard 2).  Id
``n_layer`` is accepted there, but the graph must then fill ``t_layer_inp[n_layer]`` or
``llm_graph_result::set_outputs`` asserts on the first decode (src/llama-graph.cpp:1384,
hazard 1); only the deepseek4, mimo2 and nemotron-h graphs do (src/models/deepseek4.cpp:1329,
src/models/mimo2.cpp:238, src/models/nemotron-h.cpp:238).

Architectures that can expose layer inputs
------------------------------------------
Determined by reading the sources: ``extract_layer_inputs`` (src/llama-context.cpp:2278-2309)
copies ``res->get_layer_inp(il)`` for each enabled id and aborts when the tensor is missing, and
it asserts that one row is exactly ``n_embd`` floats (src/llama-context.cpp:2298).  The only
writers of ``res->t_layer_inp`` are graph builders in ``src/models/*.cpp`` (``grep t_layer_inp``;
no shared base builder writes it).  Mapping each of those graph classes back to its
architectures through ``llama_model_mapping`` (src/llama-model.cpp:45-348), the ``using graph =
...`` aliases in src/models/models.h and the arch names in src/llama-arch.cpp gives
:data:`LAYER_INPUT_ARCHS`.  Left out on purpose: ``qwen4exp`` (its layer input is the
hyper-connection stack, ``n_embd * hc`` wide, so the row-width assert fires,
src/models/qwen4exp.cpp:398 with hc > 1 required at :52) and ``llama-embed`` (an embedding model
without KV cache, never a generation target).  Every other architecture (gpt2, phi3, gemma3,
qwen2, mistral3, ...) leaves ``t_layer_inp`` empty and enabling capture aborts llama.cpp.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from pyllama_dspark.errors import DraftMismatchError, ModelFileError, UnsupportedArchError

__all__ = [
    "LAYER_INPUT_ARCHS",
    "FINAL_LAYER_INPUT_ARCHS",
    "DRAFT_ARCH",
    "DraftInfo",
    "TargetInfo",
    "read_gguf",
    "read_draft_info",
    "read_target_info",
    "validate_pair",
    "format_draft_info",
    "field_value",
    "tokenizer_fingerprint",
]

DRAFT_ARCH = "dflash"
GGUF_MAGIC = b"GGUF"

#: Target architectures whose llama.cpp graph fills ``t_layer_inp[0..n_layer-1]`` with
#: ``n_embd``-wide rows (see the module docstring for how this was determined):
#: graph class (src/models/<file>.cpp:<line of the t_layer_inp store>) -> arch names.
_LAYER_INPUT_SOURCES: Dict[str, Tuple[str, ...]] = {
    "llama.cpp:127": ("llama",),
    "qwen3.cpp:72": ("qwen3",),
    "qwen3moe.cpp:81": ("qwen3moe",),
    "qwen3next.cpp:153": ("qwen3next",),
    "qwen35.cpp:156": ("qwen35",),
    "qwen35moe.cpp:179": ("qwen35moe",),
    "gemma4.cpp:196": ("gemma4",),
    "deepseek4.cpp:1240": ("deepseek4",),
    "mimo2.cpp:109": ("mimo2",),
    "nemotron-h.cpp:205": ("nemotron_h", "nemotron_h_moe"),  # models.h:1549 graph alias
    "hunyuan-vl.cpp:86": ("hunyuan_vl", "hunyuan-dense"),  # models.h:2111 graph alias
    "lfm2.cpp:252": ("lfm2", "lfm2moe"),  # models.h:2176 graph alias
    "openai-moe.cpp:76": ("gpt-oss",),
    "minimax-01.cpp:242": ("minimax-01",),
    "minimax-m2.cpp:63": ("minimax-m2",),
    "muse-glimmer.cpp:80": ("muse-glimmer",),
    "nanbeige.cpp:106": ("nanbeige",),
    "bailingmoe3.cpp:253": ("bailingmoe3",),
}

LAYER_INPUT_ARCHS: frozenset = frozenset(a for archs in _LAYER_INPUT_SOURCES.values() for a in archs)

#: Architectures whose graph also fills ``t_layer_inp[n_layer]`` (the last layer's output)
#: when it is enabled, so for them a target layer id equal to ``n_layer`` is valid.
FINAL_LAYER_INPUT_ARCHS: frozenset = frozenset({"deepseek4", "mimo2", "nemotron_h", "nemotron_h_moe"})

# GGML types llama.cpp keeps fc in without the F16 overflow of hazard 9
_F16_NAMES = ("F16",)


# --------------------------------------------------------------------------------------------
# low-level reading
# --------------------------------------------------------------------------------------------

_CACHE_LOCK = threading.Lock()
_READER_CACHE: "OrderedDict[tuple, Any]" = OrderedDict()
_INFO_CACHE: "OrderedDict[tuple, Any]" = OrderedDict()
_CACHE_SIZE = 6


def _file_key(path: str) -> tuple:
    st = os.stat(path)
    return (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _cache_get(cache: OrderedDict, key: tuple):
    with _CACHE_LOCK:
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
    return None


def _cache_put(cache: OrderedDict, key: tuple, value) -> None:
    with _CACHE_LOCK:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > _CACHE_SIZE:
            cache.popitem(last=False)


def _check_path(path) -> str:
    if path is None:
        raise ModelFileError("no model path given")
    try:
        path = os.fspath(path)
    except TypeError:
        raise ModelFileError(f"model path must be a str or os.PathLike, got {type(path).__name__}") from None
    if not os.path.exists(path):
        raise ModelFileError(f"model file not found: {path!r}")
    if os.path.isdir(path):
        raise ModelFileError(f"model path is a directory, not a GGUF file: {path!r}")
    if not os.path.isfile(path):
        raise ModelFileError(f"model path is not a regular file: {path!r}")
    return path


_READER_CLASS = None


def _reader_class():
    """gguf.GGUFReader whose mapped buffer is held as a plain ndarray view of the memmap.

    GGUFReader slices its ``np.memmap`` once per metadata item; every slice of the memmap
    subclass pays for ``memmap.__array_finalize__``, which makes parsing a 50k-token vocabulary
    take seconds.  Viewing the same mapping as a plain ndarray (same memory, same lifetime) keeps
    the reader's behaviour and is about three times faster.
    """
    global _READER_CLASS
    if _READER_CLASS is None:
        import gguf

        class _PlainViewReader(gguf.GGUFReader):
            @property
            def data(self):
                return self._pyllama_buf

            @data.setter
            def data(self, value):
                self._pyllama_buf = value.view(np.ndarray) if isinstance(value, np.memmap) else value

        _READER_CLASS = _PlainViewReader
    return _READER_CLASS


def read_gguf(path, *, use_cache: bool = True):
    """Open ``path`` with :class:`gguf.GGUFReader` and check it is a complete GGUF file.

    Raises :class:`ModelFileError` for a missing path, a directory, a file that is not GGUF
    (bad magic), an unreadable/corrupt header, and a truncated file (any tensor's data extending
    past the end of the file -- the reader memory-maps the file and may not notice this itself).

    Readers are cached per (real path, inode, size, mtime) because parsing a large vocabulary
    takes seconds; pass ``use_cache=False`` for a fresh reader.
    """
    path = _check_path(path)
    key = _file_key(path)
    if use_cache:
        cached = _cache_get(_READER_CACHE, key)
        if cached is not None:
            return cached

    size = key[3]
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelFileError(f"cannot read model file {path!r}: {exc}") from exc
    if len(magic) < 4 or magic != GGUF_MAGIC:
        shown = magic[:4]
        raise ModelFileError(
            f"not a GGUF file (bad magic {shown!r}, expected b'GGUF'): {path!r}"
            + (" (empty file)" if size == 0 else ""))

    try:
        reader = _reader_class()(path, "r")
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError,
            MemoryError, OSError, AssertionError, EOFError) as exc:
        raise ModelFileError(
            f"cannot parse GGUF file {path!r} (truncated or corrupt: {type(exc).__name__}: {exc})"
        ) from exc

    # the reader memory-maps the file: check every tensor's data really lies inside it
    end_needed = 0
    worst = None
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > end_needed:
            end_needed, worst = end, t.name
    if end_needed > size:
        raise ModelFileError(
            f"truncated GGUF file {path!r}: tensor {worst!r} needs {end_needed} bytes, "
            f"the file has {size}")
    if int(reader.data_offset) > size:
        raise ModelFileError(f"truncated GGUF file {path!r}: tensor data starts past the end of file")

    if use_cache:
        _cache_put(_READER_CACHE, key, reader)
    return reader


_MISSING = object()


def field_value(reader, key: str, default: Any = _MISSING) -> Any:
    """The value of metadata ``key`` as plain Python (str / int / float / bool / list).

    Strings that are not valid UTF-8 are returned as ``bytes``.  Without ``default`` a missing
    key raises ``KeyError``.
    """
    import gguf

    f = reader.fields.get(key)
    if f is None:
        if default is _MISSING:
            raise KeyError(key)
        return default
    vt = gguf.GGUFValueType
    main = f.types[0] if f.types else None

    def _str(arr) -> Any:
        raw = arr.tobytes()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw

    if main == vt.STRING:
        return _str(f.parts[f.data[0]])
    if main == vt.ARRAY:
        sub = f.types[-1]
        if sub == vt.STRING:
            return [_str(f.parts[i]) for i in f.data]
        if sub == vt.ARRAY:  # nested arrays: not used by any key we read
            return [f.parts[i].tolist() for i in f.data]
        if not f.data:
            return []
        vals = np.concatenate([np.asarray(f.parts[i]).reshape(-1) for i in f.data])
        return [bool(v) for v in vals] if sub == vt.BOOL else vals.tolist()
    arr = np.asarray(f.parts[f.data[0]]).reshape(-1)
    if main == vt.BOOL:
        return bool(arr[0])
    return arr[0].item()


def _scalar(reader, key: str, default: Any = None, *, kind=int) -> Any:
    """Scalar metadata that llama.cpp also accepts as a per-layer array (``get_key_or_arr``)."""
    v = field_value(reader, key, None)
    if v is None:
        return default
    if isinstance(v, list):
        if not v:
            return default
        v = max(v) if kind in (int, float) else v[0]
    try:
        return kind(v)
    except (TypeError, ValueError):
        raise ModelFileError(f"metadata key {key!r} has an unexpected value {v!r}") from None


def tokenizer_fingerprint(reader) -> str:
    """sha256 (hex) of the tokenizer model name and the ordered token list (raw bytes)."""
    h = hashlib.sha256()
    f = reader.fields.get("tokenizer.ggml.model")
    h.update(f.parts[f.data[0]].tobytes() if f is not None else b"")
    h.update(b"\x00\x01")
    toks = reader.fields.get("tokenizer.ggml.tokens")
    if toks is not None:
        h.update(b"\x00".join(toks.parts[i].tobytes() for i in toks.data))
    return h.hexdigest()


def _n_tokens(reader) -> int:
    toks = reader.fields.get("tokenizer.ggml.tokens")
    return len(toks.data) if toks is not None else 0


def _tensor_map(reader) -> Dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def _ne(t) -> Tuple[int, ...]:
    """ggml ne (fastest dimension first), as llama.cpp's create_tensor shapes are written."""
    return tuple(int(x) for x in t.shape)


# --------------------------------------------------------------------------------------------
# draft
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DraftInfo:
    """What a DFlash/DSpark draft GGUF says about itself (all from metadata + tensor table)."""

    path: str
    arch: str
    kind: str                              # "dspark" (Markov head present) or "dflash"
    block_size: int                        # dflash.block_size (gamma), required
    target_layers_raw: Tuple[int, ...]     # dflash.target_layers exactly as stored
    target_layer_ids: Tuple[int, ...]      # ids for llama_set_embeddings_layer_inp (== raw)
    sample_from_anchor: bool               # effective value (missing key -> True, as llama.cpp)
    sample_from_anchor_key: Optional[bool]  # as stored, None when absent
    causal: bool                           # dflash.attention.causal (missing -> False)
    causal_key: Optional[bool]
    has_confidence_head: bool              # metadata (missing -> True) AND conf_proj.weight present
    confidence_key: Optional[bool]
    has_conf_tensor: bool
    has_conf_bias: bool
    has_markov: bool                       # markov_w1.weight and markov_w2.weight present
    markov_rank: int                       # 0 when no Markov head
    has_markov_scale: bool                 # markov_w2.scale present
    mask_token_id: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int                           # from the tokenizer (llama.cpp's n_vocab)
    n_vocab_draft: int                     # d2t size for reduced-vocab drafts, else n_vocab
    has_d2t: bool
    has_own_lm_head: bool                  # output.weight or token_embd.weight in the draft
    has_own_tok_embd: bool
    fc_type: str                           # ggml type name of fc.weight
    fc_shape: Tuple[int, ...]              # ggml ne of fc.weight
    has_fc_scale: bool
    rope_type: str                         # "neox" | "mrope" | "norm" (as llama_model_rope_type)
    rope_freq_base: float
    rope_sections: Tuple[int, ...]
    n_ctx_train: int
    rms_eps: float
    is_dflash2: bool                       # DFlash2 conv/selector draft
    is_dsv4: bool                          # DeepSeek-V4 hyper-connection backbone
    tokenizer_model: str
    tokenizer_fingerprint: str
    problems: Tuple[str, ...] = ()         # things validate_pair rejects (e.g. F16 fc)
    notes: Tuple[str, ...] = ()            # non-fatal remarks

    @property
    def target_layers_hf(self) -> Tuple[int, ...]:
        """HF-style ids (hidden state *after* 0-based layer i): ``raw - 1``."""
        return tuple(i - 1 for i in self.target_layers_raw)

    @property
    def n_target_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def n_embd_inp_enc(self) -> int:
        """Width of one injected feature row (llama.cpp's n_embd_inp_enc)."""
        return len(self.target_layer_ids) * self.n_embd

    @property
    def fc_is_f16(self) -> bool:
        return self.fc_type.upper() in _F16_NAMES

    @property
    def max_drafts(self) -> int:
        """Draft tokens one block yields (anchor-first DSpark: gamma, DFlash in place: gamma-1)."""
        return self.block_size if (self.has_markov and self.sample_from_anchor) else self.block_size - 1


def _bool_key(reader, key: str) -> Optional[bool]:
    v = field_value(reader, key, None)
    if v is None:
        return None
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)):
        return bool(v)
    if isinstance(v, str):
        return v.strip().lower() == "true"
    return bool(v)


def read_draft_info(path, *, use_cache: bool = True) -> DraftInfo:
    """Read and sanity-check a DFlash/DSpark draft GGUF.

    Raises :class:`ModelFileError` for unreadable files and :class:`DraftMismatchError` when the
    file is not a usable ``dflash`` draft: wrong arch, no ``dflash.block_size`` (llama.cpp aborts
    creating a DSpark context without it, hazard 4), no/empty ``dflash.target_layers``, no
    ``tokenizer.ggml.mask_token_id`` or one outside the vocabulary, tensor shapes that do not
    match the metadata, a half-present Markov head, a bad ``d2t`` table.  An F16 ``fc.weight``
    (hazard 9) is recorded in :attr:`DraftInfo.problems` and rejected by :func:`validate_pair`.
    """
    path = _check_path(path)
    key = ("draft",) + _file_key(path)
    if use_cache:
        cached = _cache_get(_INFO_CACHE, key)
        if cached is not None:
            return cached
    r = read_gguf(path, use_cache=use_cache)
    name = os.path.basename(path)

    arch = field_value(r, "general.architecture", None)
    if arch != DRAFT_ARCH:
        raise DraftMismatchError(
            f"{name}: not a DFlash/DSpark draft: general.architecture is {arch!r}, expected {DRAFT_ARCH!r}")
    a = arch

    def need(k: str, what: str) -> Any:
        v = field_value(r, k, None)
        if v is None:
            raise DraftMismatchError(f"{name}: draft lacks required metadata {k!r} ({what})")
        return v

    block_size = field_value(r, f"{a}.block_size", None)
    if block_size is None:
        raise DraftMismatchError(
            f"{name}: draft lacks '{a}.block_size' (the trained block size gamma); llama.cpp aborts "
            f"creating a DSpark draft context without it")
    block_size = int(block_size)
    if block_size < 1:
        raise DraftMismatchError(f"{name}: '{a}.block_size' is {block_size}, must be >= 1")

    raw_layers = field_value(r, f"{a}.target_layers", None)
    if raw_layers is None:
        raise DraftMismatchError(f"{name}: draft lacks '{a}.target_layers' (llama.cpp refuses to load it)")
    if not isinstance(raw_layers, list):
        raw_layers = [raw_layers]
    raw_layers = tuple(int(x) for x in raw_layers)
    if not raw_layers:
        raise DraftMismatchError(f"{name}: '{a}.target_layers' is empty")
    if any(x < 0 for x in raw_layers):
        raise DraftMismatchError(f"{name}: '{a}.target_layers' has negative ids {list(raw_layers)}")
    if len(set(raw_layers)) != len(raw_layers):
        raise DraftMismatchError(f"{name}: '{a}.target_layers' repeats an id: {list(raw_layers)}")

    n_embd = int(need(f"{a}.embedding_length", "hidden size"))
    n_layer = int(need(f"{a}.block_count", "number of draft layers"))
    n_head = _scalar(r, f"{a}.attention.head_count", 0)
    n_head_kv = _scalar(r, f"{a}.attention.head_count_kv", n_head)
    head_dim = _scalar(r, f"{a}.attention.key_length", (n_embd // n_head) if n_head else 0)
    n_ff = _scalar(r, f"{a}.feed_forward_length", 0)
    n_ctx_train = _scalar(r, f"{a}.context_length", 0)
    rms_eps = _scalar(r, f"{a}.attention.layer_norm_rms_epsilon", 0.0, kind=float)
    rope_freq_base = _scalar(r, f"{a}.rope.freq_base", 10000.0, kind=float)
    sections = field_value(r, f"{a}.rope.dimension_sections", None)
    sections = tuple(int(x) for x in (sections if isinstance(sections, list) else ([sections] if sections is not None else [])))
    hc_mult = _scalar(r, f"{a}.hyper_connection_count", 0)

    n_vocab = _n_tokens(r)
    if n_vocab <= 0:
        raise DraftMismatchError(f"{name}: draft has no tokenizer (tokenizer.ggml.tokens); it must carry the target's")

    mask = field_value(r, "tokenizer.ggml.mask_token_id", None)
    if mask is None:
        raise DraftMismatchError(f"{name}: draft lacks 'tokenizer.ggml.mask_token_id' (the block's mask token)")
    mask = int(mask)
    if not 0 <= mask < n_vocab:
        raise DraftMismatchError(f"{name}: mask_token_id {mask} is outside the vocabulary (0..{n_vocab - 1})")

    tensors = _tensor_map(r)
    problems: List[str] = []
    notes: List[str] = []

    fc = tensors.get("fc.weight")
    if fc is None:
        raise DraftMismatchError(f"{name}: draft lacks tensor 'fc.weight'")
    fc_ne = _ne(fc)
    want_fc = (len(raw_layers) * n_embd, n_embd)
    if fc_ne[:2] != want_fc:
        raise DraftMismatchError(
            f"{name}: fc.weight has ne {list(fc_ne)}, expected {list(want_fc)} "
            f"({len(raw_layers)} target layers x n_embd {n_embd} -> n_embd)")
    fc_type = fc.tensor_type.name
    if fc_type.upper() in _F16_NAMES:
        problems.append(
            "fc.weight is F16: on CPU llama.cpp converts the fc input to F16 and target activations "
            "above 65504 become inf/NaN (hazard 9); convert fc to F32, BF16 or Q8_0")

    for tname in ("enc.output_norm.weight", "output_norm.weight"):
        if tname not in tensors:
            raise DraftMismatchError(f"{name}: draft lacks tensor {tname!r}")

    w1 = tensors.get("markov_w1.weight")
    w2 = tensors.get("markov_w2.weight")
    conf = tensors.get("conf_proj.weight")
    d2t = tensors.get("d2t")

    n_vocab_draft = n_vocab
    if d2t is not None:
        n_vocab_draft = int(_ne(d2t)[0])
        vals = np.asarray(d2t.data).reshape(-1)
        if vals.size != n_vocab_draft:
            raise DraftMismatchError(f"{name}: d2t holds {vals.size} entries, its shape says {n_vocab_draft}")
        if vals.size and (int(vals.min()) < 0 or int(vals.max()) >= n_vocab):
            raise DraftMismatchError(
                f"{name}: d2t maps to token ids {int(vals.min())}..{int(vals.max())}, outside the vocabulary 0..{n_vocab - 1}")
        if np.unique(vals).size != vals.size:
            raise DraftMismatchError(f"{name}: d2t contains duplicate target token ids")
        if n_vocab_draft > n_vocab:
            raise DraftMismatchError(f"{name}: d2t size {n_vocab_draft} exceeds the vocabulary {n_vocab}")

    has_markov = w1 is not None
    markov_rank = 0
    if has_markov:
        if w2 is None:
            raise DraftMismatchError(f"{name}: draft has markov_w1.weight but no markov_w2.weight")
        markov_rank = int(_ne(w1)[0])
        if _ne(w1)[:2] != (markov_rank, n_vocab):
            raise DraftMismatchError(
                f"{name}: markov_w1.weight has ne {list(_ne(w1))}, expected [{markov_rank}, {n_vocab}] (rank, n_vocab)")
        if _ne(w2)[:2] != (markov_rank, n_vocab_draft):
            raise DraftMismatchError(
                f"{name}: markov_w2.weight has ne {list(_ne(w2))}, expected [{markov_rank}, {n_vocab_draft}]")
        if conf is not None and _ne(conf)[:2] != (n_embd + markov_rank, 1):
            raise DraftMismatchError(
                f"{name}: conf_proj.weight has ne {list(_ne(conf))}, expected [{n_embd + markov_rank}, 1]")
    else:
        if w2 is not None:
            raise DraftMismatchError(f"{name}: draft has markov_w2.weight but no markov_w1.weight")
        if conf is not None:
            raise DraftMismatchError(
                f"{name}: draft has conf_proj.weight without a Markov head; llama.cpp only loads the "
                f"confidence head together with markov_w1/markov_w2")

    conf_key = _bool_key(r, f"{a}.has_confidence_head")
    has_conf_tensor = conf is not None
    has_conf = has_conf_tensor and (conf_key is None or conf_key)
    if has_conf_tensor and conf_key is False:
        notes.append("conf_proj.weight is present but dflash.has_confidence_head is false: confidence not used")
    if conf_key and not has_conf_tensor:
        notes.append("dflash.has_confidence_head is true but there is no conf_proj.weight: "
                     "llama.cpp's confidence rows would be garbage, treating the draft as having no confidence head")
    if has_markov and not has_conf:
        notes.append("no confidence head: confidence scheduling (p_min / survival) is unavailable")

    sfa_key = _bool_key(r, f"{a}.sample_from_anchor")
    sample_from_anchor = True if sfa_key is None else sfa_key
    causal_key = _bool_key(r, f"{a}.attention.causal")
    causal = bool(causal_key) if causal_key is not None else False

    tok_embd = tensors.get("token_embd.weight")
    out = tensors.get("output.weight")
    has_own_lm_head = out is not None or tok_embd is not None
    if n_vocab_draft < n_vocab and out is None:
        raise DraftMismatchError(
            f"{name}: reduced-vocab draft (d2t, {n_vocab_draft} rows) must carry its own output.weight")

    if hc_mult > 0:
        rope_type = "norm"
    elif any(sections):
        rope_type = "mrope"
    else:
        rope_type = "neox"

    is_dflash2 = "selector_hidden.weight" in tensors
    if is_dflash2:
        notes.append("DFlash2 (conv/selector) draft: its proposals come from the selector lattice")
    if not sample_from_anchor:
        notes.append("bonus-anchor layout (sample_from_anchor = false): slot 0 is not a prediction")
    if causal:
        notes.append("draft block attention is causal (dflash.attention.causal = true)")

    tok_model = field_value(r, "tokenizer.ggml.model", "")
    info = DraftInfo(
        path=path,
        arch=arch,
        kind="dspark" if has_markov else "dflash",
        block_size=block_size,
        target_layers_raw=raw_layers,
        target_layer_ids=tuple(raw_layers),
        sample_from_anchor=sample_from_anchor,
        sample_from_anchor_key=sfa_key,
        causal=causal,
        causal_key=causal_key,
        has_confidence_head=has_conf,
        confidence_key=conf_key,
        has_conf_tensor=has_conf_tensor,
        has_conf_bias="conf_proj.bias" in tensors,
        has_markov=has_markov,
        markov_rank=markov_rank,
        has_markov_scale="markov_w2.scale" in tensors,
        mask_token_id=mask,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=int(n_head or 0),
        n_head_kv=int(n_head_kv or 0),
        head_dim=int(head_dim or 0),
        n_ff=int(n_ff or 0),
        n_vocab=n_vocab,
        n_vocab_draft=n_vocab_draft,
        has_d2t=d2t is not None,
        has_own_lm_head=has_own_lm_head,
        has_own_tok_embd=tok_embd is not None,
        fc_type=fc_type,
        fc_shape=fc_ne,
        has_fc_scale="fc.scale" in tensors,
        rope_type=rope_type,
        rope_freq_base=float(rope_freq_base),
        rope_sections=sections,
        n_ctx_train=int(n_ctx_train or 0),
        rms_eps=float(rms_eps),
        is_dflash2=is_dflash2,
        is_dsv4=hc_mult > 0,
        tokenizer_model=tok_model if isinstance(tok_model, str) else repr(tok_model),
        tokenizer_fingerprint=tokenizer_fingerprint(r),
        problems=tuple(problems),
        notes=tuple(notes),
    )
    if use_cache:
        _cache_put(_INFO_CACHE, key, info)
    return info


# --------------------------------------------------------------------------------------------
# target
# --------------------------------------------------------------------------------------------

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
    def max_layer_id(self) -> int:
        """Largest layer-input id that can be enabled on this target without an abort."""
        return self.n_layer if self.accepts_final_layer_id else self.n_layer - 1

    @property
    def valid_layer_ids(self) -> range:
        return range(0, self.max_layer_id + 1)


def _unsupported_msg(arch: str, name: str) -> str:
    return (f"{name}: target architecture {arch!r} cannot expose layer inputs to a DFlash/DSpark draft "
            f"(its llama.cpp graph does not fill them; enabling capture would abort). Supported: "
            f"{', '.join(sorted(LAYER_INPUT_ARCHS))}")


def read_target_info(path, *, require_layer_inputs: bool = True, use_cache: bool = True) -> TargetInfo:
    """Read the target GGUF's hyper-parameters, vocabulary and tokenizer fingerprint.

    With ``require_layer_inputs`` (the default) an architecture whose graph cannot expose layer
    inputs raises :class:`UnsupportedArchError`; pass ``False`` to just inspect such a model.
    """
    path = _check_path(path)
    key = ("target",) + _file_key(path)
    info = _cache_get(_INFO_CACHE, key) if use_cache else None
    if info is None:
        r = read_gguf(path, use_cache=use_cache)
        name = os.path.basename(path)
        arch = field_value(r, "general.architecture", None)
        if not isinstance(arch, str) or not arch:
            raise ModelFileError(f"{name}: GGUF has no general.architecture")
        a = arch
        n_embd = field_value(r, f"{a}.embedding_length", None)
        n_layer_all = field_value(r, f"{a}.block_count", None)
        if n_embd is None or n_layer_all is None:
            raise ModelFileError(f"{name}: GGUF lacks {a}.embedding_length / {a}.block_count")
        n_nextn = int(field_value(r, f"{a}.nextn_predict_layers", 0) or 0)
        n_head = _scalar(r, f"{a}.attention.head_count", 0)
        n_vocab = _n_tokens(r)
        if n_vocab <= 0:
            raise ModelFileError(f"{name}: GGUF has no tokenizer (tokenizer.ggml.tokens)")
        tok_model = field_value(r, "tokenizer.ggml.model", "")
        tok_pre = field_value(r, "tokenizer.ggml.pre", "")
        bos = field_value(r, "tokenizer.ggml.bos_token_id", None)
        eos = field_value(r, "tokenizer.ggml.eos_token_id", None)
        info = TargetInfo(
            path=path,
            arch=arch,
            n_embd=int(n_embd),
            n_layer=int(n_layer_all) - n_nextn,
            n_layer_all=int(n_layer_all),
            n_vocab=n_vocab,
            n_ctx_train=int(_scalar(r, f"{a}.context_length", 0) or 0),
            n_head=int(n_head or 0),
            n_head_kv=int(_scalar(r, f"{a}.attention.head_count_kv", n_head) or 0),
            head_dim=int(_scalar(r, f"{a}.attention.key_length",
                                 (int(n_embd) // n_head) if n_head else 0) or 0),
            n_ff=int(_scalar(r, f"{a}.feed_forward_length", 0) or 0),
            rope_freq_base=float(_scalar(r, f"{a}.rope.freq_base", 10000.0, kind=float)),
            rms_eps=float(_scalar(r, f"{a}.attention.layer_norm_rms_epsilon", 0.0, kind=float)),
            tokenizer_model=tok_model if isinstance(tok_model, str) else repr(tok_model),
            tokenizer_pre=tok_pre if isinstance(tok_pre, str) else repr(tok_pre),
            tokenizer_fingerprint=tokenizer_fingerprint(r),
            supports_layer_inputs=arch in LAYER_INPUT_ARCHS,
            accepts_final_layer_id=arch in FINAL_LAYER_INPUT_ARCHS,
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=None if eos is None else int(eos),
        )
        if use_cache:
            _cache_put(_INFO_CACHE, key, info)
    if require_layer_inputs and not info.supports_layer_inputs:
        raise UnsupportedArchError(_unsupported_msg(info.arch, os.path.basename(info.path)))
    return info


# --------------------------------------------------------------------------------------------
# pair validation
# --------------------------------------------------------------------------------------------

def validate_pair(draft_info: DraftInfo, target_info: TargetInfo) -> List[str]:
    """Check that ``draft_info`` can run against ``target_info`` without a llama.cpp abort.

    Raises :class:`UnsupportedArchError` for a target arch without layer-input capture and
    :class:`DraftMismatchError` (naming both values) for: n_embd mismatch (hazard 5), vocabulary
    size mismatch, tokenizer mismatch, a target layer id out of range (hazards 1 and 2), an F16
    ``fc.weight`` (hazard 9).  Returns a list of human-readable warnings for non-fatal things.
    """
    d, t = draft_info, target_info
    dn, tn = os.path.basename(d.path), os.path.basename(t.path)

    if not t.supports_layer_inputs:
        raise UnsupportedArchError(_unsupported_msg(t.arch, tn))

    if d.n_embd != t.n_embd:
        raise DraftMismatchError(
            f"draft n_embd {d.n_embd} ({dn}) != target n_embd {t.n_embd} ({tn}); "
            f"llama.cpp aborts creating the draft context")
    if d.n_vocab != t.n_vocab:
        raise DraftMismatchError(
            f"draft vocabulary size {d.n_vocab} ({dn}) != target vocabulary size {t.n_vocab} ({tn})")
    if d.tokenizer_fingerprint != t.tokenizer_fingerprint:
        raise DraftMismatchError(
            f"draft tokenizer ({d.tokenizer_model}, fingerprint {d.tokenizer_fingerprint[:16]}) differs "
            f"from the target tokenizer ({t.tokenizer_model}, fingerprint {t.tokenizer_fingerprint[:16]}): "
            f"{dn} was not made for {tn}")

    for lid in d.target_layer_ids:
        if lid < 0 or lid > t.n_layer:
            raise DraftMismatchError(
                f"draft target layer id {lid} ({dn}, dflash.target_layers = {list(d.target_layers_raw)}) "
                f"is out of range for target {tn} ({t.arch}, n_layer {t.n_layer}): valid ids are "
                f"0..{t.max_layer_id}; llama_set_embeddings_layer_inp would abort")
        if lid == t.n_layer and not t.accepts_final_layer_id:
            raise DraftMismatchError(
                f"draft target layer id {lid} ({dn}) equals the target's n_layer {t.n_layer} ({tn}, "
                f"{t.arch}): the {t.arch} graph never fills that layer input and the first target "
                f"decode would abort; valid ids are 0..{t.max_layer_id}")

    if d.fc_is_f16:
        raise DraftMismatchError(
            f"draft fc.weight is F16 ({dn}): target layer inputs of {tn} overflow F16 (> 65504) on "
            f"CPU and the draft produces inf/NaN; convert fc to F32, BF16 or Q8_0")
    for p in d.problems:
        raise DraftMismatchError(f"{dn}: {p}")

    warnings: List[str] = []
    if d.has_own_tok_embd or (d.has_own_lm_head and not d.has_d2t):
        # (a reduced-vocabulary draft needs its own lm_head rows: nothing to warn about)
        warnings.append(f"{dn} carries its own embeddings/lm_head; they are used instead of the target's")
    if d.n_ctx_train and t.n_ctx_train and d.n_ctx_train < t.n_ctx_train:
        warnings.append(f"draft context length {d.n_ctx_train} < target context length {t.n_ctx_train}")
    if d.rope_type == "mrope":
        warnings.append("draft uses M-RoPE sections: injected rows need 4 positions each")
    if d.has_markov and not d.has_confidence_head:
        warnings.append("DSpark draft without a confidence head: use conf_min = 0 (no confidence cuts)")
    warnings.extend(d.notes)
    return warnings


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------

def _yn(v: Optional[bool]) -> str:
    return "absent" if v is None else ("true" if v else "false")


def format_draft_info(draft_info: DraftInfo, target_info: Optional[TargetInfo] = None) -> str:
    """Human-readable report of a draft (and its fit to a target) for ``pyllama-dspark inspect``."""
    d = draft_info
    lines = [
        f"draft:              {d.path}",
        f"  arch / kind:      {d.arch} / {d.kind}" + ("  (DFlash2 selector)" if d.is_dflash2 else ""),
        f"  layers:           {d.n_layer} x (n_embd {d.n_embd}, heads {d.n_head}/{d.n_head_kv} kv, "
        f"head_dim {d.head_dim}, n_ff {d.n_ff})",
        f"  block_size:       {d.block_size}  (max drafts per block: {d.max_drafts})",
        f"  target_layers:    {list(d.target_layers_raw)} as stored = layer-input ids "
        f"(HF hidden-state ids {list(d.target_layers_hf)}); feature row {d.n_embd_inp_enc} floats",
        f"  sample_from_anchor: {d.sample_from_anchor} (key {_yn(d.sample_from_anchor_key)})",
        f"  causal attention: {d.causal} (key {_yn(d.causal_key)})",
        "  markov head:      " + (f"rank {d.markov_rank}" + (" + w2 scale" if d.has_markov_scale else "")
                                   if d.has_markov else "none"),
        f"  confidence head:  {d.has_confidence_head} (key {_yn(d.confidence_key)}, "
        f"conf_proj tensor {'present' if d.has_conf_tensor else 'absent'})",
        f"  mask token id:    {d.mask_token_id}",
        f"  vocabulary:       {d.n_vocab} tokens ({d.tokenizer_model}, fingerprint {d.tokenizer_fingerprint[:16]})"
        + (f"; reduced draft vocab {d.n_vocab_draft} via d2t" if d.has_d2t else ""),
        "  lm_head / embd:   " + ("own" if d.has_own_lm_head else "shared from the target (ctx_other)"),
        f"  fc.weight:        {d.fc_type} ne {list(d.fc_shape)}" + (" + scale" if d.has_fc_scale else ""),
        f"  rope:             {d.rope_type}, freq_base {d.rope_freq_base:g}"
        + (f", sections {list(d.rope_sections)}" if any(d.rope_sections) else ""),
    ]
    for p in d.problems:
        lines.append(f"  PROBLEM: {p}")
    for n in d.notes:
        lines.append(f"  note: {n}")
    if target_info is not None:
        t = target_info
        lines += [
            f"target:             {t.path}",
            f"  arch:             {t.arch} ({'layer inputs supported' if t.supports_layer_inputs else 'NO layer-input capture'})",
            f"  n_layer / n_embd: {t.n_layer} / {t.n_embd}; valid layer ids 0..{t.max_layer_id}",
            f"  vocabulary:       {t.n_vocab} tokens ({t.tokenizer_model}, fingerprint {t.tokenizer_fingerprint[:16]})",
        ]
        try:
            warns = validate_pair(d, t)
        except DraftMismatchError as exc:  # includes UnsupportedArchError
            lines.append(f"pair:               INCOMPATIBLE: {exc}")
        else:
            lines.append("pair:               compatible")
            seen = set(d.notes)
            for w in warns:
                if w not in seen:
                    lines.append(f"  warning: {w}")
    return "\n".join(lines)
