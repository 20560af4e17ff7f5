"""Every benchmark option that writes a file refuses a path it could not write before any work.

A benchmark measures for minutes (on a GPU machine, minutes that are rare) and writes its JSON or
its picture last; a path that cannot be written must fail at once, not after the measurement. The
scripts follow the CLI's rule (``tree_attn.files.unwritable``, missing folders are created) through
one helper, ``tree_attn.files.exit_if_unwritable``: exit status 2 and one line on stderr,
``SCRIPT: error: cannot write OPTION PATH: <why>``, as argparse ends a usage error.

How it is checked, cheaply (each script imports torch; one process per script would cost ~2 s
each on two cores):

* every script of ``WRITERS`` is run for real, all in one child process (torch loaded once; each
  script run as ``__main__`` with its own ``sys.argv``), with an output path under a regular file.
  That it did no work is read from what it left: nothing on stdout (where each prints its table),
  nothing on stderr but the one line (where each prints its progress, and a GPU script on this
  machine its "no GPU" line), no file created. Not from the time it took.
* three scripts are also run as plain ``python3 benchmarks/X.py`` processes (the exit status and
  stderr a user sees), with the other kinds of bad path: a folder given as the file, a folder no
  one can write (procfs);
* ``WRITERS`` is checked against the sources: every script that writes a file is in it, with every
  option of its that names one, so that a new script or option is not left out unnoticed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tree_attn.files import cannot_write, exit_if_unwritable

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

# (script, its other arguments, the option that names a file it writes). bench_fabric writes its
# picture also in --plot-from mode, which draws earlier runs and measures nothing; the JSON named
# there does not exist, so a script that read it before the check would fail another way.
WRITERS = [
    ("bench_costmodel.py", [], "--out"),
    ("bench_cpu_local.py", [], "--json"),
    ("bench_cpu_rows.py", [], "--json"),
    ("bench_decode.py", [], "--out"),
    ("bench_fabric.py", [], "--json"),
    ("bench_fabric.py", [], "--plot"),
    ("bench_fabric.py", ["--plot-from", "missing-run.json"], "--plot"),
    ("bench_generate.py", [], "--out"),
    ("bench_host.py", [], "--out"),
    ("bench_kernel.py", [], "--out"),
    ("bench_paged.py", [], "--out"),
    ("bench_paper_harness.py", [], "--json"),
    ("bench_prefill.py", [], "--out"),
    ("bench_step.py", [], "--out"),
    ("calibrate_costmodel.py", [], "--out"),
    ("logit_agreement.py", [], "--out"),
    ("sass_loop.py", [], "--out"),
    ("spill_sweep.py", [], "--out"),
]

# Runs each (script, argv) of stdin as __main__ in this one process; prints what each did.
_RUN_EACH = r"""
import contextlib, io, json, os, runpy, sys

results = []
for script, argv in json.load(sys.stdin):
    sys.argv = [script, *argv]
    out, err = io.StringIO(), io.StringIO()
    code = "ran to its end"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:
        code = f"raised {type(exc).__name__}: {exc}"
    results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""

# Options whose value is a file the script writes (--plot-from, --table-from, --report name files read).
_WRITING_OPTION = re.compile(r"""add_argument\(\s*["'](--(?:out|json|plot|output|junit|save)(?:-[a-z]+)?)["']""")
_WRITES = re.compile(r"atomic_write_(?:text|bytes)\(|\.savefig\(|\.write_(?:text|bytes)\(|open\([^)]*[\"'][wa]b?[\"']")


def _env() -> dict[str, str]:
    # The scripts import this checkout's tree_attn (they put the repository root first on sys.path).
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_every_writing_script_and_option_is_covered():
    """The sources: every benchmark that writes a file is in WRITERS, with each option naming one."""
    covered = {(script, option) for script, _, option in WRITERS}
    missing = []
    for path in sorted(BENCH.glob("*.py")):
        text = path.read_text()
        options = {o for o in _WRITING_OPTION.findall(text) if not o.endswith("-from")}  # --plot-from: read
        missing += [f"{path.name} {o}" for o in sorted(options) if (path.name, o) not in covered]
        if _WRITES.search(text) and not any(s == path.name for s, _ in covered):
            missing.append(f"{path.name} (writes a file)")
    assert not missing, f"not in WRITERS (add them, and their check): {missing}"
    assert all((BENCH / s).is_file() for s, _, _ in WRITERS)


def test_every_benchmark_refuses_a_path_under_a_file_before_any_work(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    cases = []
    for i, (script, extra, option) in enumerate(WRITERS):
        name = f"out{i}.png" if option == "--plot" else f"out{i}.json"
        cases.append((script, extra, option, blocker / name))
    runs = [[str(BENCH / s), [*extra, option, str(bad)]] for s, extra, option, bad in cases]
    # A script that did not check first would measure for minutes: the limit ends the test there.
    proc = subprocess.run([sys.executable, "-c", _RUN_EACH], input=json.dumps(runs), capture_output=True,
                          text=True, cwd=tmp_path, env=_env(), timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    wrong = []
    for (script, extra, option, bad), got in zip(cases, results, strict=True):
        expected = f"{script}: error: cannot write {option} {bad}: {blocker} is a file, not a folder\n"
        if (got["code"], got["stdout"], got["stderr"]) != (2, "", expected):
            wrong.append(f"{script} {' '.join(extra)} {option}: exit {got['code']!r}, "
                         f"stdout {got['stdout'][-300:]!r}, stderr {got['stderr'][-600:]!r}")
    assert not wrong, "\n".join(wrong)
    # Nothing written or made: no output, no folder, no test file of the check left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
    assert blocker.read_text() == "x"


@pytest.mark.parametrize("script,extra,option", [
    ("bench_kernel.py", ["--quick"], "--out"),  # a GPU benchmark: the path first, the missing GPU after
    ("bench_cpu_rows.py", ["--tokens", "64", "--sq", "1", "--repeats", "1"], "--json"),  # would measure here
    ("bench_fabric.py", [], "--plot"),
])
def test_a_script_run_as_a_user_runs_it(script, extra, option, tmp_path):
    """``python3 benchmarks/X.py``: a folder given as the file, and a folder no one can write."""
    bad = [(tmp_path, "it is a folder, not a file")]
    if os.path.isdir("/proc/self"):  # procfs refuses a new file to every user, root included
        bad.append((Path("/proc/tree-attn-bench.json"), "the folder /proc cannot be written"))
    for path, why in bad:
        proc = subprocess.run([sys.executable, str(BENCH / script), *extra, option, str(path)], capture_output=True,
                              text=True, cwd=tmp_path, env=_env(), timeout=120, check=False)
        assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
        assert proc.stdout == ""
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{script}: error: cannot write {option} {path}: {why}"), lines
    assert list(tmp_path.iterdir()) == []


def test_the_helper(tmp_path, capsys):
    """Paths not given are skipped; a good path passes and nothing is made; the first bad one of
    several ends the script with status 2 and its line; the line is the CLI's own."""
    parser = argparse.ArgumentParser(prog="bench_x.py")
    (tmp_path / "a-file").write_text("x")
    good, bad = tmp_path / "new" / "deeper" / "r.json", tmp_path / "a-file" / "r.json"
    exit_if_unwritable(parser, {"--out": good, "--plot": None})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as exc:
        exit_if_unwritable(parser, {"--out": good, "--json": bad, "--plot": tmp_path})
    assert exc.value.code == 2
    line = f"cannot write --json {bad}: {tmp_path / 'a-file'} is a file, not a folder"
    assert capsys.readouterr().err == f"bench_x.py: error: {line}\n"
    assert cannot_write(bad, "--json") == line and cannot_write(good, "--json") is None

    from tree_attn.cli.common import check_output
    from tree_attn.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(line)):
        check_output(bad, "--json")
