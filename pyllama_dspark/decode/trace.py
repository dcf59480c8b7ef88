"""The speculation trace of a streamed reply (``serve``'s request field ``dspark_trace``, the
``DSpark`` class's argument of the same name), as JSON.

Per streamed chunk, :func:`trace_json` says where each of its tokens came from and what each
cycle behind them did::

    "dspark_trace": {
      "tokens": [{"id": 9906, "piece": "Hello", "bytes": [72, 101, 108, 108, 111],
                  "source": "draft" | "target", "cycle": 3, "pos": 0}, ...],
      "cycles": [{"cycle": 3, "drafted": 7, "verified": 4, "accepted": 2, "tokens": 3}, ...]
    }

``source`` "draft": a drafted token the target accepted; "target": the target's own token (the
prefill's first token, a cycle's correction or its bonus token).  ``pos``: the token's place in
its cycle's emitted run (drafts first).  A cycle: ``drafted`` tokens the draft pass proposed for
this request (0: no draft pass), ``verified`` of them checked by the target (what the schedule
chose), ``accepted`` of those taken, ``tokens`` it emitted into this reply (fewer than
``accepted + 1`` when the reply ended inside it).  Cycle 0 is the prefill.  Summed over a reply,
``verified`` is ``timings.draft_n`` and ``accepted`` is ``timings.draft_n_accepted``.
``piece`` is the token's text (``bytes`` decoded with replacement; a token that splits a UTF-8
character has the bytes, not the character).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence

__all__ = ["trace_json"]


def trace_json(tokens: Sequence[int], trace: Sequence[tuple], piece: Callable[[int], bytes]) -> Dict[str, Any]:
    """The ``dspark_trace`` object of a chunk (``tokens``, ``trace``: :class:`~..decode.cycle.Chunk`'s;
    ``piece``: a token's bytes)."""
    out: List[dict] = []
    cycles: List[dict] = []
    i = 0
    for cycle, drafted, verified, accepted, n in trace:
        cycles.append({"cycle": int(cycle), "drafted": int(drafted), "verified": int(verified),
                       "accepted": int(accepted), "tokens": int(n)})
        for j in range(int(n)):
            t = int(tokens[i])
            b = piece(t)
            out.append({"id": t, "piece": b.decode("utf-8", errors="replace"), "bytes": list(b),
                        "source": "draft" if j < accepted else "target", "cycle": int(cycle), "pos": j})
            i += 1
    return {"tokens": out, "cycles": cycles}
