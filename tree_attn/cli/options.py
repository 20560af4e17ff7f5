"""The CLI's options, declared once.

Options that several commands share are ``Annotated`` types here: the flag names and the help live
in the type, and a command writes only ``world_size: WorldSize = DEFAULTS.world_size``. Defaults are
never written here: each comes from the command's options dataclass (``RunOptions``,
``GenerateOptions``, ``TuneRequest``, ``SimulateOptions``), which takes it from
:mod:`tree_attn.commands.defaults` or :mod:`tree_attn.launch.setup`, so a default lives in one place
(tests/cli/test_options.py checks that the CLI's equal the dataclasses').

Counts (tokens, sequences) take one syntax everywhere: ``65536``, ``64K``, ``5.12M``
(:mod:`tree_attn.sizes`). A value that is not a count is the option parser's refusal (exit 2, as
for "abc" given to a number); a count out of the option's range is the tool's (exit 1, a
ConfigError naming it).
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ..errors import ConfigError
from ..sizes import parse_count, parse_count_list
from ..topology.host import DEFAULT_CPU_RANKS

# The host fallback's rank count for probe and check (what run and tune spawn without a GPU).
CPU_RANKS_HELP = (f"Number of CPU ranks of the host fallback (without a GPU, or --backend host); default "
                  f"{DEFAULT_CPU_RANKS}, as run and tune use.")


# -- counts ------------------------------------------------------------------------------------------


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


def count_option(*names: str, help: str) -> Any:
    """A ``typer.Option`` for a count (tokens, sequences): ``65536``, ``64K``, ``5.12M``."""
    return typer.Option(*names, parser=_count, metavar="N", help=with_suffix_rule(help))


def count_list_option(*names: str, help: str) -> Any:
    """A ``typer.Option`` for a comma list of counts (``16K,64K,1M``), passed on as the checked string."""
    return typer.Option(*names, parser=_count_list, metavar="N,N,...", help=with_suffix_rule(help))


def _int_list(value: Any) -> str:
    """A comma list of plain integers (world sizes): a non-integer is refused as ``int`` options refuse one."""
    items = [t.strip() for t in str(value).split(",") if t.strip()]
    if not items:
        raise typer.BadParameter(f"expected a comma-separated list of integers; got {str(value)!r}")
    for t in items:
        if not t.lstrip("+-").isdigit():
            raise typer.BadParameter(f"{t!r} is not an integer")
    return str(value)


def int_list_option(*names: str, help: str) -> Any:
    """A ``typer.Option`` for a comma list of integers, passed on as the checked string."""
    return typer.Option(*names, parser=_int_list, metavar="N,N,...", help=help)


# -- where and how the ranks run (run, generate, tune) ---------------------------------------------

WorldSize = Annotated[int | None, typer.Option(
    "--world-size", "-w",
    help="Ranks (default: GPUs present, else 4 CPU ranks; torchrun's WORLD_SIZE under torchrun).")]
Device = Annotated[str, typer.Option(
    "--device", help="auto, cpu or cuda: where the ranks compute (auto: the GPUs if torch sees any, else CPU ranks).")]
Backend = Annotated[str, typer.Option("--backend", help="auto, gloo or nccl (auto: nccl on GPUs, gloo on CPU).")]
Timeout = Annotated[float, typer.Option(
    "--timeout", help="Seconds a collective may wait for a peer before the job fails (a bound on waiting, not on the "
                      "job's length).")]

# -- what the ranks decode (run, generate) -----------------------------------------------------------

Strategy = Annotated[str, typer.Option(
    "--strategy", "-s", help="Comma list of tree, allreduce, ring; auto = the profile's (or default) plan and ring.")]
Fanout = Annotated[int | None, typer.Option("--fanout", "-k", help="Fan-out of the tree strategy (2..world size).")]
Plan = Annotated[str, typer.Option(
    "--plan", help="Shape of the tree strategy's plan: auto (the profile's plan on one machine; across torchrun "
                   "nodes the hierarchical tree of the node layout, or the plan of a --profile that tune wrote under "
                   "the same torchrun job), hier (the hierarchical tree: inside each node first, one message per node "
                   "across the network), or flat (a k-ary tree in rank order, fan-out --fanout, default 2, ignoring "
                   "the topology: what the hierarchical tree is compared against).")]
Profile = Annotated[str | None, typer.Option(
    "--profile", "-p", help="A profile (path or built-in name) to take the plan and kernel configs from; default: the "
                            "one saved for this machine's fingerprint, else a built-in one for the same machine, else "
                            "built-in defaults.")]

# -- the attention shape (run, tune, simulate) -------------------------------------------------------

Heads = Annotated[int, typer.Option("--heads", help="Query heads.")]
KvHeads = Annotated[int, typer.Option("--kv-heads", help="KV heads (heads must be a multiple).")]
HeadDim = Annotated[int, typer.Option("--head-dim", help="Head dimension.")]
Batch = Annotated[int, count_option("--batch", "-b", help="Sequences decoded together.")]

# -- measuring the fabric (probe, check) ------------------------------------------------------------

# The default is the library's (topology.measure.MEASURE_ITERATIONS); typer shows it in the help.
Iterations = Annotated[int, typer.Option(
    "--iterations", help="Timed iterations per measurement, after a warm-up (the median is kept).")]

# -- output -------------------------------------------------------------------------------------------

Json = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the table.")]
