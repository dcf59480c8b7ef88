"""Side-by-side benchmark runs: every configuration on every prompt, interleaved per prompt.

Configurations (all on the same target, each with its own contexts, loaded once):

* ``none``   -- the target alone (the baseline);
* ``dflash`` -- the draft in DFlash mode: the same GGUF without the Markov / confidence heads
  (:func:`~pyllama_dspark.drafts.dflash_mode.dflash_mode_draft`), i.e. plain parallel drafting;
* ``dspark`` -- the draft as it is, with the default automatic verification schedule (drafts
  verified only where it pays on this machine's cost curve);
* ``dspark-fixed`` -- the draft as it is, every drafted token verified: llama.cpp's fixed block
  (what llama-server does; the configuration to read tau and per-position acceptance from);
* ``dspark-static`` / ``dspark-survival`` -- DSpark with confidence-scheduled verification through
  the batched decoder (:class:`~pyllama_dspark.decode.loop.Decoder`, one sequence): verify up to the
  first confidence below ``conf_min`` / while the prefix survival stays above ``p_survival_min``
  (greedy only; drafts with a confidence head only).

For each prompt the configurations run back to back, in an order rotated from prompt to prompt, so
machine noise hits every configuration alike.  A prompt with several turns (mt-bench) is a
conversation: turn k+1 is sent with the configuration's own answer to turn k as the assistant
message, as llama.cpp's SpeedBench client does.  Per request the result keeps what llama-server's
``timings`` would report (prompt / decode tokens and ms, drafted / accepted) plus the cycle count and
the per-position conditional acceptance counts.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from pyllama_dspark.drafts.spec import DraftSpec, parse_draft
from pyllama_dspark.prompts import PromptItem

CONFIGS = ("none", "dflash", "dspark", "dspark-fixed", "dspark-static", "dspark-survival")
#: configurations that verify every drafted token (llama.cpp's behaviour)
FIXED_BLOCK = ("dflash", "dspark-fixed")
SCHEDULED = {"dspark-static": "static", "dspark-survival": "survival"}


@dataclass
class RequestResult:
    config: str
    source: str
    category: str
    index: int
    turns: int
    n_prompt: int = 0
    n_generated: int = 0
    ms_prefill: float = 0.0
    ms_decode: float = 0.0
    latency_s: float = 0.0
    drafted: int = 0
    accepted: int = 0
    cycles: int = 0
    pos_drafted: List[int] = field(default_factory=list)
    pos_accepted: List[int] = field(default_factory=list)
    tokens: List[int] = field(default_factory=list)      # generated tokens of every turn, concatenated

    @property
    def decode_tps(self) -> float:
        return 1e3 * self.n_generated / self.ms_decode if self.ms_decode > 0 else 0.0

    def add(self, stats, tokens: Sequence[int], latency_s: float) -> None:
        self.n_prompt += stats.n_prompt
        self.n_generated += stats.n_generated
        self.ms_prefill += stats.ms_prefill
        self.ms_decode += stats.ms_total
        self.latency_s += latency_s
        self.drafted += stats.drafted
        self.accepted += stats.accepted
        self.cycles += stats.cycles
        for name in ("pos_drafted", "pos_accepted"):
            acc, new = getattr(self, name), list(getattr(stats, name))
            acc.extend([0] * (len(new) - len(acc)))
            for i, v in enumerate(new):
                acc[i] += v
        self.tokens.extend(int(t) for t in tokens)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["decode_tps"] = self.decode_tps
        return d


def rotated(configs: Sequence[str], i: int) -> List[str]:
    k = i % len(configs) if configs else 0
    return list(configs[k:]) + list(configs[:k])


def draft_for(config: str, draft) -> Optional[DraftSpec]:
    """The draft configuration ``config`` runs (None: none): ``draft`` (a path, an ``-md`` name or a
    :class:`~pyllama_dspark.drafts.spec.DraftSpec`) as it is, or in DFlash mode."""
    if config == "none":
        return None
    draft = parse_draft(draft)
    if draft is None:
        raise ValueError(f"configuration {config!r} needs a draft")
    if config == "dflash":
        return draft.as_dflash_mode()
    if config in ("dspark", "dspark-fixed") or config in SCHEDULED:
        return draft
    raise ValueError(f"unknown configuration {config!r}; known: {', '.join(CONFIGS)}")


class ScheduledRunner:
    """DSpark with a verify policy, through the batched decoder on one sequence (greedy)."""

    def __init__(self, target: str, draft: DraftSpec, mode: str, *, n_max: int = 7, conf_min: float = 0.5,
                 p_survival_min: float = 0.3, n_ctx: int = 4096, n_threads=None, flash_attn: str = "auto",
                 n_gpu_layers="auto", **offload):
        from pyllama_dspark.decode.loop import Decoder
        from pyllama_dspark.llama.handles import ContextSettings
        from pyllama_dspark.llama.models import open_models
        from pyllama_dspark.speculative.policy import VerifyPolicy

        cs = ContextSettings(n_ctx=n_ctx, n_threads=n_threads, flash_attn=flash_attn, n_gpu_layers=n_gpu_layers,
                             **offload)
        self.target, self.draft, _ = open_models(target, draft.file(target), cs)
        try:
            policy = VerifyPolicy(mode=mode, conf_min=conf_min if mode == "static" else 0.0,
                                  p_survival_min=p_survival_min if mode == "survival" else 0.0, gamma=n_max)
            self.decoder = Decoder(self.target, self.draft, n_max=n_max, policy=policy)
        except BaseException:
            self.target.close()
            raise

    def chat_prompt(self, messages):
        from pyllama_dspark.chat.prompt import build_chat_prompt

        return build_chat_prompt(self.target, messages)

    def generate(self, tokens, max_tokens: int, stop=(), sampling=None):
        if sampling is not None:
            raise ValueError("scheduled configurations are greedy only")
        return self.decoder.run([list(tokens)], max_tokens, stop)[0]

    def close(self) -> None:
        self.target.close()


def has_confidence_head(draft: Optional[str]) -> bool:
    if draft is None:
        return False
    from pyllama_dspark.gguf.info import read_draft_info

    info = read_draft_info(draft)
    return bool(info.has_markov and info.has_confidence_head)


def open_configs(target: str, draft, configs: Sequence[str], *, n_max: int = 7,
                 conf_min: float = 0.5, p_survival_min: float = 0.3, **settings):
    """One runner per configuration ({name: Speculator or ScheduledRunner}); n_max clamped to what
    each draft makes."""
    import warnings

    from pyllama_dspark.decode.api import Speculator

    out: Dict[str, object] = {}
    try:
        for name in configs:
            if name in SCHEDULED:
                out[name] = ScheduledRunner(target, draft_for(name, draft), SCHEDULED[name], n_max=n_max,
                                            conf_min=conf_min, p_survival_min=p_survival_min, **settings)
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sp = Speculator(target, draft_for(name, draft), n_max=n_max,
                                schedule="auto" if name == "dspark" else "off", **settings)
            out[name] = sp
    except BaseException:
        for sp in out.values():
            sp.close()
        raise
    return out


def run_request(sp, config: str, item: PromptItem, n_predict: int, sampling=None) -> RequestResult:
    res = RequestResult(config, item.source, item.category, item.index, len(item.turns))
    messages: List[dict] = []
    for turn in item.turns:
        messages.append({"role": "user", "content": turn})
        cp = sp.chat_prompt(messages)
        if hasattr(sp, "prepare"):   # -md oracle:P: its reference continuation, outside the clock
            sp.prepare(cp.tokens, n_predict)
        t0 = time.perf_counter()
        kw = {"stop": cp.stop}
        if sampling is not None:
            kw["sampling"] = sampling
        done = sp.generate(cp.tokens, n_predict, **kw)
        res.add(done.stats, done.tokens, time.perf_counter() - t0)
        messages.append({"role": "assistant", "content": done.text})
    return res


def run_bench(speculators: Dict[str, object], items: Sequence[PromptItem], n_predict: int, *, sampling=None,
              progress: Optional[Callable[[str, PromptItem], None]] = None) -> List[RequestResult]:
    """Every configuration on every prompt, interleaved per prompt (rotating order)."""
    names = list(speculators)
    results: List[RequestResult] = []
    for i, item in enumerate(items):
        for name in rotated(names, i):
            results.append(run_request(speculators[name], name, item, n_predict, sampling))
            if progress is not None:
                progress(name, item)
    return results
