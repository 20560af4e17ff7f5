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
import re
import sys
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from ..errors import ConfigError
from ..sizes import parse_count, parse_count_list

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


def error(message: str) -> None:
    """The one red error line on stderr (a message that spans lines is joined into one)."""
    message = " ".join(ln.strip() for ln in str(message).splitlines() if ln.strip())
    err_console.print(line(("error:", "bold red"), " ", message))


# -- counts: one syntax for every option that counts tokens or sequences (tree_attn.sizes) ---------
# A value that is not a count is the option parser's refusal (exit 2, as for "abc" given to a
# number); a count out of the option's range is the tool's (exit 1, a ConfigError naming it).


def _count(value: Any) -> int:
    try:
        return parse_count(value)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None


def _count_list(value: Any) -> str:
    """A comma list of counts, checked here and handed on as written (the command parses it with
    the same parser, and its range errors quote the user's own spelling, "200M")."""
    try:
        parse_count_list(value)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
    return str(value)


def with_suffix_rule(help: str) -> str:
    """An option's help, ending with the count syntax, stated once."""
    return f"{help.rstrip('.')}; takes K = 1,024 and M = 1,000,000 (64K, 1M)."


def count_option(default: Any, *names: str, help: str) -> Any:
    """A ``typer.Option`` for a count (tokens, sequences): ``65536``, ``64K``, ``5.12M``."""
    return typer.Option(default, *names, parser=_count, metavar="N", help=with_suffix_rule(help))


def count_list_option(default: Any, *names: str, help: str) -> Any:
    """A ``typer.Option`` for a comma list of counts (``16K,64K,1M``), passed on as the checked string."""
    return typer.Option(default, *names, parser=_count_list, metavar="N,N,...", help=with_suffix_rule(help))


def _int_list(value: Any) -> str:
    """A comma list of plain integers (world sizes): a non-integer is refused as ``int`` options refuse one."""
    items = [t.strip() for t in str(value).split(",") if t.strip()]
    if not items:
        raise typer.BadParameter(f"expected a comma-separated list of integers; got {str(value)!r}")
    for t in items:
        if not t.lstrip("+-").isdigit():
            raise typer.BadParameter(f"{t!r} is not an integer")
    return str(value)


def int_list_option(default: Any, *names: str, help: str) -> Any:
    """A ``typer.Option`` for a comma list of integers, passed on as the checked string."""
    return typer.Option(default, *names, parser=_int_list, metavar="N,N,...", help=help)
