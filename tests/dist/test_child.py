"""``run_in_child``: work in a spawned child process (the launching process of ``tune`` and
``generate`` keeps no CUDA context), its progress relayed as it comes, its errors raised here."""

from __future__ import annotations

import os

import pytest

from tests.dist import child_fns
from tree_attn.errors import ConfigError, DistributedError
from tree_attn.launch.child import run_in_child


def test_the_work_runs_in_another_process_and_every_line_arrives():
    said = []
    done = run_in_child(child_fns.report, (200,), what="the test work", timeout_s=30, progress=said.append)
    pid, value = done.value
    assert done.pid == pid != os.getpid()
    assert value == list(range(200))
    assert said == [f"line {i}" for i in range(200)]  # all of them, in order, before the call returns
    assert run_in_child(child_fns.report, (3,), what="the test work", timeout_s=30).value[1] == [0, 1, 2]


def test_a_tree_attn_error_is_raised_as_it_was():
    said = []
    with pytest.raises(ConfigError, match=r"^--heads must be an integer >= 1; got 0$"):
        run_in_child(child_fns.refuse, what="the test work", timeout_s=30, progress=said.append)
    assert said == ["about to refuse"]


def test_a_crash_or_death_names_the_work():
    with pytest.raises(DistributedError, match=r"^the test work \(a child process\) failed: ZeroDivisionError"):
        run_in_child(child_fns.crash, what="the test work", timeout_s=30)
    with pytest.raises(DistributedError,
                       match=r"^the test work \(a child process\) died \(exit code 7\) without reporting$"):
        run_in_child(child_fns.die, what="the test work", timeout_s=30)
