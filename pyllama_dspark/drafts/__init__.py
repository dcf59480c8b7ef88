"""Drafts by name: what ``-md`` names, parsed once (:mod:`.spec`), and the drafts the package writes
itself into the cache: random-weight test drafts and the oracle's draft (:mod:`.made`), a DSpark
draft's DFlash mode (:mod:`.dflash_mode`)."""
