"""Every default lives in one place: each command's CLI defaults are its options dataclass's, and
every field of the dataclass is an option of the command (issue "The house": the seed limit
had drifted between the typer options, RunOptions and RunSpec)."""

from __future__ import annotations

import dataclasses

import pytest

from tree_attn.cli.app import cli_command
from tree_attn.commands.fit import FitOptions
from tree_attn.commands.generate.setup import GenerateOptions
from tree_attn.commands.run.setup import RunOptions
from tree_attn.commands.simulate import SimulateOptions
from tree_attn.commands.tune.setup import TuneRequest

OPTIONS = {"run": RunOptions, "generate": GenerateOptions, "tune": TuneRequest, "simulate": SimulateOptions,
           "fit": FitOptions}
# CLI parameter -> dataclass field, where the names differ
FIELD = {"timeout": "timeout_s", "profile_ref": "profile"}
# CLI parameters that are not options of the job (output, and run's sweep of several jobs)
NOT_FIELDS = {"json_out", "plot", "sweep"}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_cli_defaults_are_the_options_dataclasses(name):
    command = cli_command().commands[name]
    fields = {f.name: f.default for f in dataclasses.fields(OPTIONS[name])}
    seen = set()
    for param in command.params:
        if param.name in NOT_FIELDS:
            continue
        field = FIELD.get(param.name, param.name)
        assert field in fields, f"{name} {param.opts}: no field {field!r} in {OPTIONS[name].__name__}"
        assert param.default == fields[field], (name, param.opts, param.default, fields[field])
        seen.add(field)
    assert seen == set(fields), f"{name}: fields without an option: {set(fields) - seen}"


def test_shared_options_read_alike_in_every_command():
    """An option several commands share is declared once (tree_attn/cli/options.py): the same
    flags, help and default wherever it appears with the same meaning."""
    shared = {"--device": ("run", "generate", "tune"), "--backend": ("run", "generate", "tune"),
              "--timeout": ("run", "generate", "tune"), "--strategy": ("run", "generate"),
              "--fanout": ("run", "generate"), "--plan": ("run", "generate"),
              "--profile": ("run", "generate"), "--world-size": ("run", "generate"),
              "--heads": ("run", "tune", "simulate"), "--kv-heads": ("run", "tune", "simulate"),
              "--head-dim": ("run", "tune", "simulate"), "--batch": ("run", "tune", "simulate"),
              "--json": ("run", "generate", "simulate", "fit")}
    commands = cli_command().commands
    for flag, names in shared.items():
        params = [next(p for p in commands[n].params if flag in p.opts) for n in names]
        assert len({(tuple(p.opts), p.help, p.default) for p in params}) == 1, (flag, names)


def test_the_specs_take_their_defaults_from_the_options():
    from tree_attn.commands.generate.decode import GenerateSpec
    from tree_attn.commands.run.decode import RunSpec

    run = {f.name: f.default for f in dataclasses.fields(RunSpec)}
    opts = RunOptions()
    assert (run["seq_len"], run["batch"], run["q_heads"], run["kv_heads"], run["head_dim"], run["steps"],
            run["warmup"], run["seed"], run["cuda_graph"]) == (
        opts.seq_len, opts.batch, opts.heads, opts.kv_heads, opts.head_dim, opts.steps, opts.warmup, opts.seed,
        opts.cuda_graph)
    gen = {f.name: f.default for f in dataclasses.fields(GenerateSpec)}
    assert (gen["new_tokens"], gen["page_size"], gen["seed"]) == (
        GenerateOptions().new_tokens, GenerateOptions().page_size, GenerateOptions().seed)


def test_measurement_iterations_default_is_one_constant(capsys):
    """``--iterations`` of probe and check, measure_topology and the cost-model calibration share
    one default (it was written out as 20 in each), and the help shows that value."""
    import inspect

    from tree_attn.cli.app import main
    from tree_attn.cost.calibrate import calibrate_cpu, calibrate_gpu
    from tree_attn.topology.measure import MEASURE_ITERATIONS, measure_topology

    for fn in (measure_topology, calibrate_cpu, calibrate_gpu):
        assert inspect.signature(fn).parameters["iterations"].default == MEASURE_ITERATIONS, fn.__name__
    helps = set()
    for name in ("probe", "check"):
        (param,) = [p for p in cli_command().commands[name].params if p.name == "iterations"]
        assert param.default == MEASURE_ITERATIONS, name
        helps.add(param.help)
        assert main([name, "--help"]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert f"[default: {MEASURE_ITERATIONS}]" in out.split("--iterations", 1)[1].split("--", 1)[0], name
    assert len(helps) == 1  # one help text for one option
