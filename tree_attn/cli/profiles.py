"""``tree-attn profiles``: list the built-in and saved profiles, or show one.

``tree-attn profiles`` (or ``profiles list``) lists; ``tree-attn profiles show NAME|PATH`` prints one
profile: its machine, kernel config per shape bucket and reduction candidates, each value with how
it was chosen. Nothing here probes the machine or imports torch.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich import box
from rich.table import Table

from .common import line, out_console, print_json, print_table, styled, warn

CHOSEN_STYLE = {"measured": "green", "model": "yellow", "default": "dim"}

profiles_app = typer.Typer(
    name="profiles",
    help="List the built-in and saved profiles (`profiles show NAME|PATH` prints one).",
    invoke_without_command=True,
    no_args_is_help=False,
    add_completion=False,
)


_JSON_OPT = typer.Option(False, "--json", help="Print JSON instead of a table.")
_DIR_OPT = typer.Option(None, "--dir",
                        help="Folder of saved profiles (default: $TREE_ATTN_PROFILE_DIR or the user's cache).")


@profiles_app.callback()
def profiles_root(
    ctx: typer.Context,
    json_out: bool = _JSON_OPT,
    directory: Path | None = _DIR_OPT,
) -> None:
    """List the profiles when no subcommand is given."""
    if ctx.invoked_subcommand is None:
        list_command(json_out=json_out, directory=directory)


@profiles_app.command("list", help="List the built-in profiles and those saved by `tree-attn tune`.")
def list_command(json_out: bool = _JSON_OPT, directory: Path | None = _DIR_OPT) -> None:
    from ..profiles.builtin import builtin_entries
    from ..profiles.store import default_profile_dir, list_saved_profiles

    folder = directory if directory is not None else default_profile_dir()
    if folder.exists() and not folder.is_dir():  # else listed as "no saved profiles"
        from ..errors import ConfigError

        raise ConfigError(f"the profile folder {folder} is a file: --dir (or TREE_ATTN_PROFILE_DIR) names the folder "
                          f"of saved profiles; `tree-attn profiles show {folder}` prints one profile file")
    entries = builtin_entries() + list_saved_profiles(folder)
    if json_out:
        print_json({"profile_dir": str(folder), "profiles": [e.to_dict() for e in entries]})
        return
    # One block per profile, not a table: at 80 columns eight columns wrap every cell to a few
    # characters. Names, paths and labels are Texts, never markup (a profile may be named "evil[/x]").
    # Every line is printed whole (soft wrap): a path or a plan label broken by the console's
    # width (80 columns when piped) cannot be copied back, and a terminal wraps a long line itself.
    def say(text) -> None:
        out_console.print(text, soft_wrap=True)

    for e in entries:
        p = e.profile
        if p is None:
            say(line((e.name, "bold"), "  ", (e.kind, ""), ", ", ("invalid", "red")))
            say(styled(f"    {e.path}"))
            continue
        m = p.machine
        say(line((p.name, "bold"), f"  {e.kind}, {p.origin}, created {p.created}"))
        # the whole fingerprint: `profiles show FINGERPRINT` takes it, and run names it so
        say(styled(f"    {m.world_size}x {m.device_name} ({m.device_kind}), fingerprint {m.fingerprint}"))
        say(line("    plan ", p.plan.label, " ", _chosen(f"({p.reduction.chosen_by})", p.reduction.chosen_by)))
        say(styled(f"    {e.path}"))
    saved = [e for e in entries if e.kind == "saved"]
    if not saved:
        say(styled("no saved profiles (`tree-attn tune` writes one) in"))
        say(styled(f"    {folder}"))
    for e in entries:
        if e.error:
            warn(e.error)


@profiles_app.command("show", help="Print one profile: a file path, a built-in name, "
                                   "or a saved profile's name or fingerprint.")
def show_command(
    ref: str = typer.Argument(..., metavar="NAME|PATH", help="Profile file, built-in name, "
                                                             "or saved profile name/fingerprint."),
    json_out: bool = _JSON_OPT,
    directory: Path | None = _DIR_OPT,
) -> None:
    from ..profiles.builtin import open_profile

    prof = open_profile(ref, directory)
    if json_out:
        print_json(prof.to_dict())
        return
    render_profile(prof)


def _chosen(text: str, how: str | None = None):
    """``text`` coloured by how a value was chosen (measured, model, default)."""
    return styled(text, CHOSEN_STYLE.get(how if how is not None else text, ""))


def _short_dtype(dtype: str) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)


def _tokens(n: int) -> str:
    """In the CLI's count spelling (``tree_attn.sizes``: K = 1,024, M = 1,000,000), so a bucket
    reads as its --seq-len would be written: 8192 -> 8K, 1048576 -> 1,024K, 2000000 -> 2M."""
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000:,}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024:,}K"
    return f"{n:,}"


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def render_profile(prof) -> None:
    """The human report of one profile on stdout (every value a Text, never markup)."""
    m, v = prof.machine, prof.versions
    out_console.print(line((prof.name, "bold"), f"  origin {prof.origin}, created {prof.created}, "
                                                f"schema {prof.schema_version}"))
    if prof.description:
        out_console.print(styled(prof.description))
    out_console.print(styled(
        f"machine: {m.world_size}x {m.device_name} ({m.device_kind}), fingerprint {m.fingerprint}, source {m.source}"
    ))
    if m.hierarchy:
        out_console.print(styled("hierarchy: " + " / ".join(m.hierarchy)))
    if m.link_classes:
        out_console.print(styled("links: " + ", ".join(f"{k} {n}" for k, n in m.link_classes.items())
                                 + ("; p2p: " + ", ".join(f"{k} {n}" for k, n in m.p2p.items()) if m.p2p else "")))
    versions = ", ".join(f"{k.replace('_', '-')} {getattr(v, k) or 'unknown'}" for k in v.FIELDS)
    out_console.print(styled("versions: " + versions))

    if prof.kernel.buckets:
        # Fits 80 columns without cutting a config: the bucket in one cell, no vertical rules.
        t = Table(title=styled(f"kernel configs (ranked for {prof.kernel.device_spec or 'this device'}; "
                               "time: measured, model: predicted, in us)"),
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0))
        for col in ("bucket", "config", "by", "time", "GB/s", "model", "tried"):
            t.add_column(col, justify="left" if col in ("bucket", "config", "by") else "right", no_wrap=True)
        for b in prof.kernel.buckets:
            t.add_row(
                styled(f"{_short_dtype(b.dtype)} D{b.head_dim} G{b.group} N<={_tokens(b.max_shard_len)}"),
                styled(b.config.describe()), _chosen(b.chosen_by), _us(b.time_us), _us(b.gbps), _us(b.predicted_us),
                "-" if b.candidates_tried is None else str(b.candidates_tried),
            )
        print_table(t)
    else:
        out_console.print("kernel configs: none (the launch heuristic decides every shape)", markup=False)

    red = prof.reduction
    out_console.print(line(
        "reduction plan: ", (red.plan.label, "bold"), " chosen by ", _chosen(red.chosen_by),
        f", message {red.message_bytes:,} bytes" if red.message_bytes else "",
    ), soft_wrap=True)
    if red.candidates:
        t = Table(title="reduction candidates", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 1, 0, 0))
        for col in ("", "plan", "by", "median us", "p95 us", "model us"):  # labels whole: no_wrap
            t.add_column(col, justify="right" if col.endswith("us") else "left", no_wrap=col == "plan")
        for c in red.candidates:
            t.add_row(styled("*", "bold green") if c.selected else "", styled(c.label), _chosen(c.chosen_by),
                      _us(c.median_us), _us(c.p95_us), _us(c.predicted_us))
        print_table(t)
    for n in prof.notes:
        out_console.print(f"note: {n}", markup=False)
