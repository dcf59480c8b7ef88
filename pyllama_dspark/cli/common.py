"""What every command shares: the default models as click errors, and the schedule options."""

from __future__ import annotations

from typing import Optional

import click

from pyllama_dspark import paths


def default_target() -> str:
    """The default target's path, or a usage error saying how to get it."""
    try:
        return paths.default_target()
    except paths.MissingDefaultModel as e:
        raise click.UsageError(str(e))


def resolve_draft_arg(draft: Optional[str], target: str) -> Optional[str]:
    """-md values 'random' / 'random-dspark' / 'random-dflash' become a cached random draft."""
    if draft in ("random", "random-dspark", "random-dflash"):
        return paths.random_draft_for(target, "dflash" if draft == "random-dflash" else "dspark")
    return draft
