"""Work run by ``tree_attn.launch.child.run_in_child`` in the tests (module-level: picklable)."""

from __future__ import annotations

import os


def report(n: int, say) -> tuple[int, list[int]]:
    """Say ``n`` lines, return this process's pid and the lines' numbers."""
    for i in range(n):
        say(f"line {i}")
    return os.getpid(), list(range(n))


def refuse(say) -> None:
    from tree_attn.errors import ConfigError

    say("about to refuse")
    raise ConfigError("--heads must be an integer >= 1; got 0")


def crash(say) -> None:
    raise ZeroDivisionError("division by zero in the work")


def die(say) -> None:
    os._exit(7)
