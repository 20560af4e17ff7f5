"""Shared pieces of the CLI: consoles (results on stdout, logs on stderr), JSON output, errors."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

# Results go to stdout, logs and progress to stderr (DESIGN.md conventions).
out_console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


class CliState:
    """Global flags set by the top-level callback."""

    debug: bool = False


def print_json(obj: Any) -> None:
    """Print one JSON object to stdout (plain, no colour, no wrapping)."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")
    sys.stdout.flush()


def _json_default(o: Any) -> Any:
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def notice(message: str) -> None:
    """A plain-words notice on stderr."""
    err_console.print(f"[yellow]note:[/yellow] {message}")


def warn(message: str) -> None:
    err_console.print(f"[bold yellow]warning:[/bold yellow] {message}")
