"""One RPC client process for tests/test_rpc.py (an rpc-server serves one client at a time, and a
process keeps its RPC connections, and llama.cpp's abort on losing them, until it exits).

    python tests/rpc_worker.py JOB.json OUT

JOB: {"mode": "greedy" | "law" | "features", "target", "draft", "rpc": "h:p,h:p" or null,
"ngl", "ngld", "threads", "prompts": [[token, ...], ...], "n_predict", ...}; OUT: a JSON file
(greedy, law) or an .npz file (features).
"""

from __future__ import annotations

import json
import sys

import numpy as np

from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.speculative.sampling_params import SamplingParams


def _open(job, **kw):
    return Speculator(job["target"], job.get("draft"), n_threads=job["threads"], n_ctx=job.get("n_ctx", 1024),
                      n_gpu_layers=job.get("ngl", 0), n_gpu_layers_draft=job.get("ngld"),
                      rpc=job.get("rpc"), schedule="off", n_max=7, **kw)


def greedy(job):
    """Tokens and the per-step (drafted, accepted) counts, every draft verified (drafting forced)."""
    out = []
    with _open(job) as sp:
        for prompt in job["prompts"]:
            done = sp.generate(prompt, job["n_predict"])
            steps = [(d, a) for d, a in zip(done.stats.verify_lengths, done.stats.cycle_accepted) if d > 0]
            out.append({"tokens": list(done.tokens), "steps": steps,
                        "totals": [done.stats.drafted, done.stats.accepted]})
    return out


def law(job):
    """(t1, t2) of ``n`` T > 0 generations with full blocks (the engine test's sampler and seeds)."""
    params = SamplingParams(**job["params"])
    samples = []
    with _open(job) as sp:
        for i in range(job["n"]):
            got = []
            it = sp.stream(job["prompts"][0], 9, sampling=params.with_seed(1000 + i), reuse_prefix=True)
            for ev in it:
                got += ev.tokens
                if len(got) >= 2 or (got and sp.target.is_eog(got[0])):
                    break
            it.close()
            samples.append(got[:1] if sp.target.is_eog(got[0]) else got[:2])
        markov = getattr(sp.proposer, "_markov", None)
        backend = markov.backend if markov is not None else None
    return {"samples": samples, "markov_backend": backend}


def features(job):
    """The target's captured layer inputs (the draft's features) after one prefill of the prompt."""
    with _open(job) as sp:
        prompt = np.asarray(job["prompts"][0], dtype=np.int32)
        sp.target.decode(prompt, 0)
        feats = sp.target.features(0, len(prompt)).copy()
        logits = np.stack([sp.target.logits(i) for i in range(len(prompt))])
    return {"features": feats, "logits": logits}


def main(argv):
    job = json.loads(open(argv[1]).read())
    result = {"greedy": greedy, "law": law, "features": features}[job["mode"]](job)
    if job["mode"] == "features":
        np.savez(argv[2], **result)
    else:
        with open(argv[2], "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv)
