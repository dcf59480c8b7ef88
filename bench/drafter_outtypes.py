"""The shipped SmolLM2 drafter in each outtype: file size, draft ms per block, tok/s and tau.

    python bench/drafter_outtypes.py [--prompts 6] [-n 64] [--blocks 50] [--threads 1]

f16 is the shipped file. f32, bf16 and q8_0 are ``pyllama-dspark convert --outtype ...`` of its export.
For each outtype, every prompt (the first turn of an evenly spaced pick from the packaged bench
prompts, chat template applied) runs ``Speculator.generate`` of ``-n`` tokens at ``schedule="off"``
(every draft verified, llama.cpp's fixed block). tok/s is the sum of generated tokens over the sum of
generation time. tau is (accepted + cycles) / cycles over all prompts. After each generation,
``DraftModelProposer.propose`` of a full block at the end of the text is timed ``--blocks`` times;
the table gives the median. Prints a Markdown table. Run it on an idle machine: llama.cpp's threads
spin-wait, so a busy machine measures the other jobs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.interop.convert import convert_checkpoint
from pyllama_dspark.interop.export import export_checkpoint
from pyllama_dspark.paths import default_draft, default_target
from pyllama_dspark.prompts import load_prompts

OUTTYPES = ("f16", "bf16", "q8_0", "f32")


def drafts(work: str, target: str) -> dict:
    ck = export_checkpoint(default_draft(), os.path.join(work, "ck"))
    out = {"f16": default_draft()}
    for o in OUTTYPES[1:]:
        out[o] = convert_checkpoint(ck, target, os.path.join(work, f"{o}.gguf"), outtype=o)
    return out


def measure(target: str, draft: str, prompts, n: int, blocks: int, threads: int) -> dict:
    gen = ms = acc = cycles = 0
    block_ms = []
    with Speculator(target, draft, n_ctx=2048, n_threads=threads, schedule="off") as sp:
        for text in prompts:
            prompt = list(sp.chat_prompt([{"role": "user", "content": text}]).tokens)
            done = sp.generate(prompt, n)
            st = done.stats
            gen, ms, acc, cycles = gen + st.n_generated, ms + st.ms_total, acc + st.accepted, cycles + st.cycles
            anchor, pos0 = int(done.tokens[-1]), len(prompt) + len(done.tokens) - 1
            pr = sp.proposer
            pr.propose(anchor, pos0, pr.max_draft())          # warm-up (and the deferred injections)
            for _ in range(blocks):
                t0 = time.perf_counter()
                pr.propose(anchor, pos0, pr.max_draft())
                block_ms.append((time.perf_counter() - t0) * 1e3)
    return {"size_mb": os.path.getsize(draft) / 2 ** 20, "block_ms": statistics.median(block_ms),
            "tok_s": gen / (ms / 1e3), "tau": (acc + cycles) / cycles if cycles else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    items = load_prompts()
    step = max(1, len(items) // args.prompts)
    prompts = [it.turns[0] for it in items[::step][:args.prompts]]
    target = default_target()
    with tempfile.TemporaryDirectory() as work:
        paths = drafts(work, target)
        rows = {o: measure(target, paths[o], prompts, args.n, args.blocks, args.threads) for o in OUTTYPES}
    print(f"{len(prompts)} bench prompts x {args.n} tokens, --schedule off, {args.threads} thread(s), "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    print("| outtype | file size | draft ms / block | tok/s (--schedule off) | τ |")
    print("|---|---:|---:|---:|---:|")
    for o in OUTTYPES:
        r = rows[o]
        label = "f16 (as shipped)" if o == "f16" else o
        print(f"| {label} | {r['size_mb']:.1f} MiB | {r['block_ms']:.2f} | {r['tok_s']:.1f} | {r['tau']:.2f} |")


if __name__ == "__main__":
    main()
