"""``tree-attn run --sweep``: the same run at several sequence lengths, one after the other."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ...errors import ConfigError

MAX_SWEEP = 16  # lengths in one sweep: each is a whole run


def sweep_lengths(text: str | None, default: int) -> list[int]:
    """The sweep's lengths, ascending (``None``: just ``default``)."""
    from ..defaults import parse_tokens

    if text is None:
        return [default]
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise ConfigError(f"--sweep: expected a comma-separated list of sequence lengths, got {text!r}")
    lengths = sorted({parse_tokens(t) for t in items})
    if len(lengths) > MAX_SWEEP:
        raise ConfigError(f"--sweep: at most {MAX_SWEEP} lengths (each is a whole run); got {len(lengths)}")
    return lengths


def run_sweep(options, sweep: str | None, progress: Callable[[str], None] = lambda text: None) -> list:
    """One :class:`RunResult` per length of ``sweep`` (spawned ranks only: a torchrun job runs
    one length). Every length is resolved and checked before the first run starts; each run is
    the launch its own setup resolved (the kernel config and the memory check are per length)."""
    from .decode import run_decode
    from .setup import plan_run

    lengths = sweep_lengths(sweep, options.seq_len)
    setups = [plan_run(dataclasses.replace(options, seq_len=n)) for n in lengths]  # sizes checked up front
    if setups[0].under_torchrun:
        raise ConfigError("--sweep and --plot spawn their own ranks; under torchrun run one --seq-len per job")
    results = []
    for i, setup in enumerate(setups):
        spec = setup.spec
        if i == 0:
            for n in setup.notices:
                progress(f"note: {n}")  # as a run of one length says them
            for w in setup.warnings:
                progress(f"warning: {w}")
            progress(setup.profile.text)
        progress(f"[{i + 1}/{len(setups)}] {spec.seq_len:,} tokens over {spec.world_size} ranks")
        result = run_decode(spec)
        result.profile = setup.profile
        results.append(result)
    return results
