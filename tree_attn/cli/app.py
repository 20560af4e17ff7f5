"""The ``tree-attn`` command line: one typer app, one module per command.

Command modules import torch, triton and vendor libraries lazily inside their bodies, so
``tree-attn --help`` works on any machine.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
import warnings

import typer

from ..errors import TreeAttnError
from .common import CliState, err_console, error

# numpy is optional (only the test extra installs it); without it torch warns "Failed to
# initialize NumPy" once per process that imports it: the CLI and every rank it spawns (ranks
# re-import this module as their main module before torch). tree-attn never hands torch numpy
# arrays, so the warning says nothing to its users.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

# Recent typer releases vendor click (typer._click) instead of depending on it, so `import click`
# may fail or name different classes. Take the base classes from typer's public exceptions.
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
_Exit = typer.Exit
_Abort = typer.Abort

EXIT_CODES = (
    "Exit codes: 0 success; 1 an error (one red line on stderr; --debug shows the traceback) or a "
    "failed check; 2 a usage error (an unknown option, a value that is not a number); 130 interrupted "
    "(Ctrl-C); 143 terminated (SIGTERM). Ranks it started are stopped in every case."
)

app = typer.Typer(
    name="tree-attn",
    help=(
        "Exact long-context decode attention across GPUs.\n\n"
        "Probe the GPU fabric, tune the decode kernel and the tree reduction for it, write a "
        "profile, and run tree-attention decoding under that profile."
    ),
    epilog=EXIT_CODES,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from .. import __version__

        sys.stdout.write(f"tree-attn {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors (a failing rank's too)."),
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    CliState.debug = debug


class _Interrupted(BaseException):
    """SIGINT or SIGTERM, raised where the main thread is. Not a KeyboardInterrupt: the option
    parser would turn that into a bare Abort; as a BaseException it passes every ``except
    Exception`` and runs every ``finally`` (the one that stops spawned ranks included)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum, frame) -> None:
    raise _Interrupted(signum)


def _install_signal_handlers() -> dict:
    """SIGTERM is handled like SIGINT (ranks stopped, one line, exit 128 + signal); returns the
    previous handlers. Only the main thread may set handlers (main() called from another
    thread keeps the defaults)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, _on_signal)
        except (ValueError, OSError):  # pragma: no cover - an embedding without signals
            pass
    return previous


def _register() -> None:
    # One module per command: its HELP and <name>_command (profiles: a group of subcommands,
    # profiles_app). A module missing from this build is skipped.
    for name in ("run", "generate", "probe", "check", "tune", "profiles", "simulate", "fit"):
        try:
            mod = __import__(f"{__package__}.{name}", fromlist=["HELP"])
        except ModuleNotFoundError as exc:  # a command module not present in this build
            if exc.name != f"{__package__}.{name}":
                raise
            continue
        if name == "profiles":
            app.add_typer(mod.profiles_app, name=name)
        else:
            app.command(name, help=mod.HELP)(getattr(mod, f"{name}_command"))


_register()


def _without_flag_placeholders(command):
    """Typer's help shows a value placeholder (``<bool>``) beside on/off flags such as --json,
    which take no value (``--json=true`` is refused): blank it on every flag, --help included."""
    names = type("_Names", (), {"help_option_names": ["-h", "--help"]})()
    params = list(getattr(command, "params", []))
    help_opt = command.get_help_option(names) if hasattr(command, "get_help_option") else None
    for param in params + ([help_opt] if help_opt is not None else []):
        if getattr(param, "is_flag", False):
            param.metavar = ""
    for sub in getattr(command, "commands", {}).values():
        _without_flag_placeholders(sub)
    return command


def cli_command():
    """The click command behind ``app``, as the console script runs it."""
    return _without_flag_placeholders(typer.main.get_command(app))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    args = sys.argv[1:] if argv is None else list(argv)
    # Number CUDA devices as NVML does (by PCI bus), not fastest-first: the probe's GPU i, the
    # reduction plans' rank i and the rank's cuda:i must be the same card. Set before any CUDA
    # context exists (rank processes inherit it); a value the user set is kept.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    CliState.debug = "--debug" in args
    previous = _install_signal_handlers()
    try:
        result = cli_command().main(args=args, prog_name="tree-attn", standalone_mode=False)
        code = result if isinstance(result, int) else 0
    except _Exit as exc:
        code = exc.exit_code
    except _Abort:
        error("aborted")
        code = 130
    except _ClickException as exc:
        # A usage error (exit 2): one line too, naming where the help is.
        ctx = getattr(exc, "ctx", None)
        message = exc.format_message()
        if type(exc).__name__ == "NoArgsIsHelpError":  # the help was printed: nothing went wrong
            message = ""
        where = f"; see `{ctx.command_path} --help`" if ctx is not None and exc.exit_code == 2 else ""
        if message.strip():
            error(f"{message}{where}")
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
    except (KeyboardInterrupt, _Interrupted) as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        what = "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted"
        error(what)
        code = 128 + signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if argv is None:
        sys.exit(code)
    return code
