"""The ``tree-attn`` command line: one typer app, one module per command.

Command modules import torch, triton and vendor libraries lazily inside their bodies, so
``tree-attn --help`` works on any machine.
"""

from __future__ import annotations

import os
import sys
import traceback

import typer

from ..errors import TreeAttnError
from .common import CliState, err_console, error

# Recent typer releases vendor click (typer._click) instead of depending on it, so `import click`
# may fail or name different classes. Take the base classes from typer's public exceptions.
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
_Exit = typer.Exit
_Abort = typer.Abort

app = typer.Typer(
    name="tree-attn",
    help=(
        "Exact long-context decode attention across GPUs.\n\n"
        "Probe the GPU fabric, tune the decode kernel and the tree reduction for it, write a "
        "profile, and run tree-attention decoding under that profile."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
) -> None:
    CliState.debug = debug


def _register() -> None:
    # Each command module exposes register(app). A module missing from this build is skipped.
    for name in ("run", "probe", "check", "tune", "profiles"):
        try:
            mod = __import__(f"{__package__}.{name}", fromlist=["register"])
        except ModuleNotFoundError as exc:  # a command module not present in this build
            if exc.name != f"{__package__}.{name}":
                raise
            continue
        mod.register(app)


_register()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    args = sys.argv[1:] if argv is None else list(argv)
    # Number CUDA devices as NVML does (by PCI bus), not fastest-first: the probe's GPU i, the
    # reduction plans' rank i and the rank's cuda:i must be the same card. Set before any CUDA
    # context exists (rank processes inherit it); a value the user set is kept.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    CliState.debug = "--debug" in args
    try:
        result = app(args=args, prog_name="tree-attn", standalone_mode=False)
        code = result if isinstance(result, int) else 0
    except _Exit as exc:
        code = exc.exit_code
    except _Abort:
        err_console.print("[red]aborted[/red]")
        code = 130
    except _ClickException as exc:
        exc.show()
        code = exc.exit_code
    except TreeAttnError as exc:
        if CliState.debug:
            err_console.print(traceback.format_exc(), markup=False, highlight=False)
            remote = getattr(exc, "remote_traceback", None)  # a rank's own traceback (DistributedError)
            if remote:
                err_console.print(f"the failing rank's traceback:\n{remote}", markup=False, highlight=False)
        # The message is data, not markup: gloo errors name paths like [/__w/pytorch/...].
        error(str(exc))
        code = 1
    except KeyboardInterrupt:
        err_console.print("[red]interrupted[/red]")
        code = 130
    if argv is None:
        sys.exit(code)
    return code
