"""``pyllama-dspark train``: instructions → target responses + features → training → GGUF.

Everything lives in one work directory, and every stage resumes from what is there:

* ``instructions.jsonl`` (+ ``data_card.json``: sources and counts) -- rebuilt identically from
  the seed, checked against the benchmark prompts when they are found;
* ``data/`` -- shards written by :mod:`.datagen` (resumes per instruction);
* ``vocab.npy`` -- the reduced draft vocabulary (``d2t``), fixed once chosen;
* ``train/`` -- ``ckpt.pt`` (resumes at its step) and ``train_log.jsonl``;
* the output GGUF, its model card (``.json``) and its Hugging Face checkpoint (``<stem>.hf/``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import numpy as np

from pyllama_dspark.training.datagen import GenConfig
from pyllama_dspark.training.instructions import SOURCES, build_instructions
from pyllama_dspark.training.trainer import TrainConfig

__all__ = ["PipelineConfig", "run_pipeline", "benchmark_texts", "split_indices"]


@dataclass
class PipelineConfig:
    n_prompts: int = 1600
    seed: int = 1
    vocab_size: int = 8192
    n_layers: int = 1
    markov_rank: int = 32
    block_size: int = 7
    weights_type: str = "f16"
    train_head: bool = False
    eval_every_nth: int = 30
    mix: str = "v2"
    extra_data: List[str] = field(default_factory=list)   # earlier work dirs: trained on, not regenerated
    init_from: Optional[str] = None   # a work dir whose checkpoint (+ vocabulary, feature scale) starts training
    gen: GenConfig = field(default_factory=GenConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def benchmark_texts(prompt_dir: Optional[Path]) -> List[str]:
    """Every turn of every benchmark prompt file (to keep them out of the training set)."""
    from pyllama_dspark.prompts import load_prompts

    if prompt_dir is None:
        return []
    return [str(t) for it in load_prompts([prompt_dir]) for t in it.turns]


def split_indices(n: int, every: int) -> tuple:
    ev = [i for i in range(n) if every and i % every == 0]
    s = set(ev)
    return [i for i in range(n) if i not in s], ev


def run_pipeline(target_path: str, work_dir, out_path: Optional[str], cfg: PipelineConfig,
                 stages: Sequence[str] = ("data", "train", "export"), echo: Callable[[str], None] = print,
                 prompt_dir: Optional[Path] = None) -> dict:
    from pyllama_dspark.gguf.target_info import read_target_info
    from pyllama_dspark.gguf.testing import default_target_layers

    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {}
    bench = benchmark_texts(prompt_dir)
    avoid = []
    for e in cfg.extra_data:
        ins_file = Path(e) / "instructions.jsonl"
        if not (Path(e) / "data").is_dir():
            raise FileNotFoundError(f"{e}: not a training work directory (no data/)")
        if ins_file.exists():
            avoid += [m["content"] for line in ins_file.read_text().splitlines() if line.strip()
                      for m in json.loads(line)["messages"]]
    passages = _passages(target_path, cfg.extra_data) if cfg.mix == "v3" else None
    instructions = build_instructions(cfg.n_prompts, seed=cfg.seed, exclude=bench, mix=cfg.mix, avoid=avoid,
                                      passages=passages)
    with open(work / "instructions.jsonl", "w") as f:
        for i, ins in enumerate(instructions):
            f.write(json.dumps({"id": i, "source": ins.source, "messages": ins.messages,
                                "followup": ins.followup}) + "\n")
    counts = {}
    for ins in instructions:
        counts[ins.source] = counts.get(ins.source, 0) + 1
    card = {"sources": SOURCES, "counts": counts, "n": len(instructions), "mix": cfg.mix,
            "benchmark_turns_excluded": len(bench), "seed": cfg.seed, "extra_data": list(cfg.extra_data),
            "passages": len(passages or [])}
    (work / "data_card.json").write_text(json.dumps(card, indent=1))
    ti = read_target_info(target_path)
    layers = default_target_layers(ti.n_layer)

    if "data" in stages:
        from tqdm import tqdm

        from pyllama_dspark.training.datagen import generate_dataset

        bar = tqdm(desc="responses", unit="seq")

        def prog(done, total):
            bar.total = total
            bar.n = done
            bar.refresh()

        st = generate_dataset(target_path, layers, instructions, work / "data", cfg.gen, progress=prog)
        bar.close()
        echo(f"data: {st}")
        result["data"] = st

    if "train" in stages or "export" in stages:
        import torch

        from pyllama_dspark.training.build import build_model, feature_scale, make_spec
        from pyllama_dspark.training.datagen import load_records
        from pyllama_dspark.training.trainer import Batcher, select_vocab, train

        # earlier runs first: their records keep their indices, so their held-out split stays held out
        recs = [r for e in cfg.extra_data for r in load_records(Path(e) / "data")] + load_records(work / "data")
        if cfg.init_from:
            _warm_start(Path(cfg.init_from), work)
        if not recs:
            raise RuntimeError(f"no training data in {work / 'data'}: run the data stage first")
        vpath = work / "vocab.npy"
        if vpath.exists():
            d2t = np.load(vpath)
        else:
            from pyllama_dspark.llama.handles import ContextSettings, Target

            with Target(target_path, ContextSettings(n_ctx=64)) as t:
                eog = np.nonzero(t.eog_mask)[0].tolist()
            d2t = select_vocab(recs, cfg.vocab_size, always=eog)
            np.save(vpath, d2t)
        n_resp = sum(len(r.tokens) - r.n_prompt for r in recs)
        covered = np.isin(np.concatenate([r.tokens[r.n_prompt:] for r in recs]), d2t).mean()
        echo(f"data: {len(recs)} sequences, {n_resp} response tokens, draft vocabulary {len(d2t)} "
             f"(covers {covered:.4f} of response tokens)")
        spec = make_spec(target_path, n_layers=cfg.n_layers, block_size=cfg.block_size,
                         markov_rank=cfg.markov_rank, target_layers=layers)
        spath = work / "feature_scale.npy"
        if spath.exists():
            fscale = np.load(spath)
        else:
            fscale = feature_scale(recs)
            np.save(spath, fscale)
        model = build_model(target_path, spec, d2t, train_head=cfg.train_head, seed=cfg.seed, feat_scale=fscale)
        batcher = Batcher(recs, spec.block_size, model.t2d.numpy(), pad_token=int(d2t[0]))
        tr_idx, ev_idx = split_indices(len(recs), cfg.eval_every_nth)
        (work / "train").mkdir(exist_ok=True)
        if "train" in stages:
            from tqdm import tqdm

            bar = tqdm(total=cfg.train.steps, desc="train", unit="step")

            def log(rec):
                bar.n = rec["step"]
                bar.set_postfix(loss=f"{rec['loss']:.3f}", tau=f"{rec['tau_train']:.2f}")
                if "tau_eval" in rec:
                    bar.write(f"step {rec['step']}: eval tau {rec['tau_eval']:.3f} slot acc {rec['slot_acc_eval']}")

            result["train"] = train(model, batcher, tr_idx, ev_idx, cfg.train, work / "train", log=log)
            bar.close()
        else:
            ck = work / "train" / "ckpt.pt"
            if not ck.exists():
                raise RuntimeError(f"no checkpoint at {ck}: run the train stage first")
            model.load_state_dict(torch.load(ck, weights_only=False)["model"])
        if "export" in stages and out_path:
            from pyllama_dspark.training.export import export_gguf, export_hf_beside

            export_gguf(model, target_path, out_path, cfg.weights_type)
            echo(f"wrote {out_path}")
            result["out"] = str(out_path)
            result["hf"] = export_hf_beside(out_path)    # the same draft for vLLM / sglang / llama.cpp's converter
            echo(f"wrote {result['hf']}")
            card_path = Path(str(out_path)).with_suffix(".json")
            card_path.write_text(json.dumps(_model_card(target_path, work, cfg, spec, recs, d2t, covered),
                                            indent=1, default=str))
            echo(f"wrote {card_path}")
    (work / "pipeline.json").write_text(json.dumps({"config": asdict(cfg), "result": result}, indent=1,
                                                   default=str))
    return result


PASSAGE_SOURCES = ("explain", "writing", "advice", "compare", "list", "chat", "multiturn", "stem", "writing3",
                   "roleplay")


def _passages(target_path: str, extra_data: Sequence[str]) -> List[str]:
    """Paragraphs of the target's own prose responses in the earlier datasets (mix v3's ``passage``
    family)."""
    from pyllama_dspark.llama.handles import ContextSettings, Target
    from pyllama_dspark.training.datagen import load_responses
    from pyllama_dspark.training.families_v3 import split_passages

    resp = [t for e in extra_data for t in load_responses(Path(e) / "data", PASSAGE_SOURCES)]
    if not resp:
        return []
    with Target(target_path, ContextSettings(n_ctx=64)) as t:
        texts = [t.detokenize(r.tolist(), special=False).decode("utf-8", "replace") for r in resp]
    return sorted(set(split_passages(texts)))


def _warm_start(src: Path, work: Path) -> None:
    """Copy an earlier run's checkpoint, vocabulary and feature scale into ``work`` (once: an
    existing checkpoint here is resumed instead).  Training continues at that run's step with this
    run's schedule and data."""
    import shutil

    ck = work / "train" / "ckpt.pt"
    if ck.exists():
        return
    if not (src / "train" / "ckpt.pt").exists():
        raise FileNotFoundError(f"{src}: no train/ckpt.pt to start from")
    (work / "train").mkdir(parents=True, exist_ok=True)
    for name in ("vocab.npy", "feature_scale.npy"):
        if (src / name).exists():
            shutil.copyfile(src / name, work / name)
    shutil.copyfile(src / "train" / "ckpt.pt", ck)


def _model_card(target_path: str, work: Path, cfg: PipelineConfig, spec, recs, d2t, covered: float) -> dict:
    """What the exported draft is and how it was made (shipped next to the GGUF)."""
    import os

    log = []
    lp = work / "train" / "train_log.jsonl"
    if lp.exists():
        log = [json.loads(line) for line in lp.read_text().splitlines() if line.strip()]
    evals = [r for r in log if "tau_eval" in r]
    seconds, last = 0.0, 0.0          # elapsed_s restarts at 0 when a run resumes
    for r in log:
        if r["elapsed_s"] < last:
            seconds += last
        last = r["elapsed_s"]
    seconds += last
    data_bytes = sum(f.stat().st_size for d in [work] + [Path(e) for e in cfg.extra_data]
                     for f in (d / "data").glob("shard-*.npz"))
    return {
        "target": {"file": os.path.basename(target_path), "bytes": os.path.getsize(target_path)},
        "draft": spec.to_dict() | {"vocab_draft": int(len(d2t)), "vocab_coverage_of_responses": round(float(covered), 4)},
        "instructions": json.loads((work / "data_card.json").read_text()),
        "data": {"sequences": len(recs), "sampled": int(sum(r.sampled for r in recs)),
                 "response_tokens": int(sum(len(r.tokens) - r.n_prompt for r in recs)),
                 "tokens": int(sum(len(r.tokens) for r in recs)), "shard_bytes": int(data_bytes)},
        "training": {"config": asdict(cfg.train), "steps_done": log[-1]["step"] if log else 0,
                     "warm_start_from": cfg.init_from,
                     "seconds": round(seconds, 1),
                     "eval_tau_teacher_forced": [(r["step"], round(r["tau_eval"], 4)) for r in evals],
                     "final_eval_slot_acc": evals[-1]["slot_acc_eval"] if evals else None},
    }
