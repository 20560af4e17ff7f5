"""Shared pieces of the CLI: consoles (results on stdout, logs on stderr), JSON output, errors.

Everything printed through rich is markup, so any text that comes from outside a format string
(error messages, notes, warnings, file paths, profile and device names, plan labels) must never be
interpolated into markup as is: a gloo error names ``[/__w/pytorch/...]`` and a path or a profile
name may contain ``[/x]``, which rich reads as a closing tag (a MarkupError, or text silently
swallowed). Such text goes through :func:`esc` or is printed as a :class:`rich.text.Text`
(:func:`styled`, :func:`line`), which rich never parses.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.text import Text

# Results go to stdout, logs and progress to stderr (docs/ARCHITECTURE.md, "Conventions").
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


def esc(value: Any) -> str:
    """``str(value)`` escaped for rich markup: shown as is, never read as a tag."""
    return escape(str(value))


def styled(value: Any, style: str | None = None) -> Text:
    """``value`` as a Text with ``style`` (an empty or missing style is plain text): never markup."""
    return Text(str(value), style=style or "")


def line(*parts: Any) -> Text:
    """A Text from plain pieces and ``(text, style)`` pairs, none of them parsed as markup."""
    return Text.assemble(*((str(p[0]), p[1] or "") if isinstance(p, tuple) else str(p) for p in parts))


def ranks(n: int) -> str:
    """``1 rank``, ``4 ranks``."""
    return f"{n} rank{'s' if n != 1 else ''}"


def plan_name(label: str, world_size: int) -> str:
    """A plan's label as people read it: on one rank a fan-out means nothing (nothing is sent or
    merged), so ``tree k=2`` reads ``tree`` there; elsewhere the label as it is."""
    return re.sub(r" k=\d+$", "", label) if world_size == 1 else label


def notice(message: str) -> None:
    """A plain-words notice on stderr."""
    err_console.print(line(("note:", "yellow"), " ", message))


def warn(message: str) -> None:
    err_console.print(line(("warning:", "bold yellow"), " ", message))


def announce_setup(setup: Any, summary: str) -> None:
    """What a planned job says before it starts, on stderr, once (rank 0 under torchrun): its
    notices, its warnings, the profile it uses and a one-line ``summary`` of the work."""
    if setup.rank != 0:
        return
    for n in setup.notices:
        notice(n)
    for w in setup.warnings:
        warn(w)
    err_console.print(setup.profile.text, markup=False)
    err_console.print(summary, markup=False)


def print_table(table: Any) -> None:
    """A result table on stdout with every cell whole. Rich shrinks a table wider than the console
    (80 columns when stdout is a pipe or a file) by cutting cells: a p95 of "112.16 ms" read
    "112.16 …". A table that does not fit is printed at its own width instead, uncropped (a
    terminal wraps a long line itself, and a file keeps it)."""
    from rich.measure import Measurement

    natural = Measurement.get(out_console, out_console.options.update_width(1 << 16), table).maximum
    if natural > out_console.width and table.width is None:
        table.width = natural
    out_console.print(table, crop=False)


def error(message: str) -> None:
    """The one red error line on stderr (a message that spans lines is joined into one)."""
    message = " ".join(ln.strip() for ln in str(message).splitlines() if ln.strip())
    err_console.print(line(("error:", "bold red"), " ", message))


def fmt_bytes(n: float) -> str:
    """``512 B``, ``1.5 KiB`` ... ``2.0 TiB``: bytes in the largest binary unit below 1,024."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def report(result: Any, render: Callable[[Any], None], json_out: bool, plot: str | None = None,
           draw: Callable[[Any, str], None] | None = None) -> None:
    """A command's result on stdout: one JSON object (``--json``) or the table ``render`` draws;
    then, with ``--plot``, ``draw(result, plot)``. The measurements first: a picture that cannot be
    written must not take them with it."""
    if json_out:
        print_json(result)
    else:
        render(result)
    if plot:
        draw(result, plot)
        notice(f"wrote {plot}")


def check_output(path: str | os.PathLike, option: str) -> None:
    """Before any work: refuse an output file that could not be written, in one line naming the
    option. The rule is every output option's (:func:`tree_attn.files.unwritable`): missing folders
    are created, a file where a folder should be or a folder that cannot be written is refused."""
    from ..errors import ConfigError
    from ..files import cannot_write

    problem = cannot_write(path, option)
    if problem:
        raise ConfigError(problem)


def check_plot(path: str | None) -> None:
    """Before any work: a ``--plot`` path that can be written, and matplotlib to draw it."""
    if path:
        from ..plots import check_png_path, require_matplotlib

        check_png_path(path)
        check_output(path, "--plot")
        require_matplotlib()
