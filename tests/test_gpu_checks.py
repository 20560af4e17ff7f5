"""``benchmarks/gpu_checks.sh``'s commands parse: checked on any machine, no GPU needed, nothing run.

A GPU machine is at hand rarely and for minutes; a flag renamed in a benchmark or the CLI, or a
test file moved, would otherwise be found only there, at the cost of a step. In its dry-run mode
(``GPU_CHECKS_DRY_RUN=1``) the script prints each selected step's command instead of running it;
every step of every group is collected, and each command is checked by kind:

* ``python3 -m tree_attn ...``: parsed by the CLI's own click command (options, values, choices),
  not invoked;
* ``python3 benchmarks/X.py ...``: the script run with argparse stopped right after it parsed the
  arguments (its type converters included), in one child process for all of them;
* ``python3 -m pytest ...``: every test file or folder it names exists, and every marker it selects
  is registered in pyproject.toml.

A command of any other kind fails here, so that a new kind gets its check. Two steps' code runs
here for real as well: ``sass-loop`` (compile-time facts, no GPU needed) and the code behind
``bench-generate --kernel-time``, eagerly on CPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_checks.sh"
# Every step's variants: --quick and full limits/shapes differ for some, and `short` has its own.
RUNS = (["--quick", "tests", "bench", "cli", "fp8"], ["bench"], ["short"], ["readme"])

_STOP_AFTER_PARSING = r"""
import argparse, contextlib, io, json, runpy, sys

class Parsed(Exception):
    pass

def parse_args(self, args=None, namespace=None):
    original_parse_args(self, args, namespace)
    raise Parsed

original_parse_args = argparse.ArgumentParser.parse_args
argparse.ArgumentParser.parse_args = parse_args
results = []
for script, argv in json.load(sys.stdin):
    sys.argv = [script, *argv]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            runpy.run_path(script, run_name="__main__")
        results.append("ran to its end without parsing arguments")
    except Parsed:
        results.append(None)
    except SystemExit as exc:
        results.append(f"exit {exc.code}: {err.getvalue().strip()[-600:]}")
print(json.dumps(results))
"""


def _steps(script: Path, tmp_path: Path, runs=RUNS) -> list[tuple[str, list[str]]]:
    """(step name, command) for every step of every run of ``runs``."""
    steps = []
    env = {**os.environ, "GPU_CHECKS_DRY_RUN": "1"}
    for i, groups in enumerate(runs):
        proc = subprocess.run(["bash", str(script), str(tmp_path / f"out{i}"), *groups], capture_output=True,
                              text=True, env=env, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        for record in filter(None, proc.stdout.split("\x1e")):
            name, limit, *command = record.split("\x1f")[:-1]
            assert int(limit) > 0, record
            steps.append((name, command))
    return steps


def _declared_steps(script: Path) -> set[str]:
    text = script.read_text()
    block = re.search(r"all_steps=\((.*?)\)", text, re.DOTALL)
    assert block, "gpu_checks.sh: no all_steps=(...) list"
    return set(block.group(1).split())


def _check_cli(command: list[str]) -> str | None:
    from tree_attn.cli.app import cli_command

    group = cli_command()  # typer's own click: its classes, not an installed click's
    click_exception = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
    parent = group.context_class(group, info_name="tree-attn")
    sub = group.get_command(parent, command[0])
    if sub is None:
        return f"no command {command[0]!r}"
    try:
        with sub.make_context(command[0], list(command[1:]), parent=parent):
            pass
    except click_exception as exc:
        return exc.format_message()
    return None


def _check_pytest(command: list[str]) -> str | None:
    listed = re.search(r"^markers = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.DOTALL | re.MULTILINE)
    markers = set(re.findall(r'^\s*"(\w+):', listed.group(1), re.MULTILINE))  # tomllib: Python 3.11+
    takes_value = {"-m", "-k", "-n", "--timeout", "-p"}
    args = iter(command)
    for arg in args:
        if arg in takes_value:
            value = next(args)
            if arg == "-m":
                unknown = set(re.findall(r"[A-Za-z_]\w*", value)) - markers - {"not", "and", "or"}
                if unknown:
                    return f"-m {value!r}: markers not registered in pyproject.toml: {sorted(unknown)}"
        elif not arg.startswith("-") and not (ROOT / arg.split("::")[0]).exists():
            return f"{arg}: no such test file or folder"
    return None


def _problems(script: Path, tmp_path: Path, only: str | None = None) -> list[str]:
    """One line per step of ``script`` whose command does not parse, naming the step and why; with
    ``only``, that step's commands in the first run of :data:`RUNS` alone."""
    if only is None:
        steps = _steps(script, tmp_path)
        missing = _declared_steps(script) - {name for name, _ in steps}
        problems = [f"{name}: in all_steps but in no group that this test runs" for name in sorted(missing)]
    else:
        steps = [(name, command) for name, command in _steps(script, tmp_path, RUNS[:1]) if name == only]
        problems = []
    scripts = []
    for name, command in steps:
        if command[:3] == ["python3", "-m", "tree_attn"]:
            problem = _check_cli(command[3:])
        elif command[:3] == ["python3", "-m", "pytest"]:
            problem = _check_pytest(command[3:])
        elif command[:1] == ["python3"] and command[1].startswith("benchmarks/") and command[1].endswith(".py"):
            problem = None if (ROOT / command[1]).is_file() else f"{command[1]}: no such script"
            if problem is None:
                scripts.append((name, command[1], command[2:]))
        else:
            problem = "a command of a kind this test does not check: add its check here"
        if problem:
            problems.append(f"{name}: {problem}")
    child = subprocess.run([sys.executable, "-c", _STOP_AFTER_PARSING], input=json.dumps([s[1:] for s in scripts]),
                           capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    assert child.returncode == 0, child.stderr[-3000:]
    outcome = json.loads(child.stdout.strip().splitlines()[-1])
    return problems + [f"{name}: {script}: {why}" for (name, script, _), why in zip(scripts, outcome) if why]


def test_every_step_of_gpu_checks_parses(tmp_path):
    problems = _problems(SCRIPT, tmp_path)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("broken, expected", [
    (("bench-kernel-fp8", "--kv-dtypes", "--kv-types"), "bench_kernel.py: exit 2"),
    (("run", "--strategy", "--strategies"), "No such option: --strategies"),
    (("fp8-tests", "tests/kernels/test_fp8_decode_gpu.py", "tests/kernels/test_fp8_gpu.py"), "no such test file"),
])
def test_a_stale_command_is_caught(tmp_path, broken, expected):
    # The negative control: one word of one step changed, as a rename elsewhere would leave it.
    step, old, new = broken
    lines = SCRIPT.read_text().splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.lstrip().startswith(f"step {step} ") and old in line]
    assert len(hits) >= 1, f"gpu_checks.sh no longer has `step {step} ... {old}`"
    for i in hits:
        lines[i] = lines[i].replace(old, new)
    copy = tmp_path / "benchmarks" / "gpu_checks.sh"
    copy.parent.mkdir()
    copy.write_text("".join(lines))
    problems = _problems(copy, tmp_path, only=step)
    assert problems and all(expected in line for line in problems), problems


def test_the_sass_loop_step_runs_here(tmp_path):
    # sass-loop needs no GPU (Triton compiles for sm_90 with its own ptxas; compile-time facts):
    # its exact command from the script runs to the end here, the extra fp8 configs included.
    pytest.importorskip("triton")
    ((_, command),) = [step for step in _steps(SCRIPT, tmp_path, RUNS[:1]) if step[0] == "sass-loop"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled builds, not the interpreter
    proc = subprocess.run([sys.executable, *command[1:]], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(Path(command[command.index("--out") + 1]).read_text())["rows"]
    extra = json.loads(command[command.index("--fp8-configs") + 1])
    fp8 = [r["config_dict"] for r in rows if r["kv"] == "fp8"]
    for config in extra:
        assert any(all(c[key] == value for key, value in config.items()) for c in fp8), (config, fp8)
    assert all(r["loop"]["total"] > 0 for r in rows)


def test_bench_generate_kernel_time_runs_on_cpu():
    # bench-generate's --kernel-time profiles generate's token step on a GPU; on CPU the same code
    # runs eagerly with no kernel time, so its calls (model, sharded prefill, token step, profiler)
    # are checked here, not first on a GPU. What only a GPU shows (the graph, CUDA events) is not.
    pytest.importorskip("transformers")
    import importlib.util

    from tree_attn.commands.generate.models import ModelSource

    spec = importlib.util.spec_from_file_location("bench_generate", ROOT / "benchmarks" / "bench_generate.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    prompt = [(7 * i + 3) % 4096 for i in range(200)]
    res = bench._kernel_time(ModelSource(preset="small", layers=1), prompt, 4, "float32", device="cpu")
    assert res["captured"] is False and res["why_eager"] == "cpu tensors: nothing to capture"
    assert res["token_median_ms"] > 0 and res["kernels_device_ms"] == 0.0 and res["wall_over_kernels"] is None
    line = bench._profile_line(dict(context=len(prompt), **res))  # printed the moment it is measured
    assert line.startswith("one-rank token step at 200: eager, ") and line.endswith("recorded no kernel time")
    measured = dict(res, context=200, captured=True, kernels_device_ms=0.5, wall_over_kernels=1.05)
    assert bench._profile_line(measured).endswith("wall/kernels 1.05x (goal <= 1.1x)")
    assert res["eager_kernels_device_ms"] == 0.0 and res["wall_over_eager_kernels"] is None
    both = dict(measured, eager_kernels_device_ms=0.48, eager_kernels_per_token=61, wall_over_eager_kernels=1.09)
    assert bench._profile_line(both).endswith(
        "(goal <= 1.1x); the same token's kernels launched eagerly: 0.480 ms of device time (61 per token), "
        "wall/those 1.09x")
