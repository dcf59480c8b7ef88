"""Open a target (+ optional draft) from paths, validating the pairing from the files first."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from pyllama_dspark.gguf.info import read_draft_info, validate_pair
from pyllama_dspark.gguf.target_info import read_target_info
from pyllama_dspark.llama.handles import ContextSettings, Draft, Target
from pyllama_dspark.llama.recurrent import snapshots_for


def open_models(target_path: str, draft_path: Optional[str],
                settings: ContextSettings) -> Tuple[Target, Optional[Draft], List[str]]:
    """(target, draft or None, warnings).  llama.cpp aborts on mismatched pairs: check them here."""
    settings.validate()
    warnings: List[str] = []
    capture, allow_last = (), False
    if draft_path is not None:
        dinfo = read_draft_info(draft_path)
        tinfo = read_target_info(target_path)
        warnings = list(validate_pair(dinfo, tinfo) or [])
        capture = dinfo.target_layer_ids
        allow_last = bool(tinfo.accepts_final_layer_id)
        if tinfo.hybrid:   # a rejected tail of a block rolls back by recurrent-state snapshots
            settings = dataclasses.replace(settings, n_rs_seq=snapshots_for(dinfo.max_drafts))
    target = Target(target_path, settings, capture_layers=capture, allow_last_layer=allow_last)
    draft = None
    if draft_path is not None:
        try:
            draft = Draft(draft_path, target, settings.for_draft())
        except BaseException:
            target.close()
            raise
    return target, draft, warnings
