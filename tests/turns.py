"""A test marked ``exclusive`` reads the time its own runs take (the automatic schedule learning from
the cycles it times): it runs while every other pytest-xdist worker waits.  A pytest plugin;
tests/conftest.py registers its hook, tests/test_turns.py checks it on a suite of its own."""

from __future__ import annotations

import os

import pytest


class Turns:
    """A test marked ``exclusive`` (it reads the time its own runs take) runs with every other xdist
    worker held: each test takes a shared flock on one file, an exclusive test an exclusive one, and a
    turnstile taken first lets a waiting exclusive test in before the other worker's next test (flock
    alone favours the readers: a worker that starts tests back to back would keep it out)."""

    def __init__(self, base: str):
        os.makedirs(base, exist_ok=True)
        self.turnstile = os.open(os.path.join(base, "turnstile.lock"), os.O_CREAT | os.O_RDWR)
        self.room = os.open(os.path.join(base, "room.lock"), os.O_CREAT | os.O_RDWR)

    def enter(self, exclusive: bool) -> None:
        import fcntl
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        fcntl.flock(self.room, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if not exclusive:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)

    def leave(self) -> None:
        import fcntl
        fcntl.flock(self.room, fcntl.LOCK_UN)
        fcntl.flock(self.turnstile, fcntl.LOCK_UN)   # held only by an exclusive test; a no-op otherwise


_TURNS: list = []   # this worker's Turns, opened at its first test


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown of each test inside its turn (module fixtures built in it too)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:   # one process: nothing runs beside it
        yield
        return
    if not _TURNS:
        import tempfile
        _TURNS.append(Turns(os.path.join(tempfile.gettempdir(), f"pyllama-dspark-turns-{run}")))
    turns = _TURNS[0]
    turns.enter(item.get_closest_marker("exclusive") is not None)
    try:
        yield
    finally:
        turns.leave()
