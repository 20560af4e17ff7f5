"""What a new user hit on a fresh clone (issue "GPU readiness by reading, and the rough edges a new
user hits", section "Found as a new user"): an empty cache benchmarked, counts spelt one way here
and another there, a check that read an A100 as a broken H100, a stale profile note, labels and
paths broken at 80 columns, progress that never reached its end, and the smaller points."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tree_attn.cli.app import cli_command, main

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "topology"
H100 = FIX / "h100_sxm5_8gpu_1nic_vm_nvidia-smi_topo_m.txt"
H200 = FIX / "h200_hgx_8gpu_12nic_nvidia-smi_topo_m.txt"
A100 = FIX / "a100_dgx_8gpu_12nic_nvidia-smi_topo_m.txt"
RTX_DUAL = FIX / "rtx4090_8gpu_dual_epyc7542_nvidia-smi_topo_m_whitespace_collapsed.txt"
SMALL = ["--heads", "4", "--kv-heads", "2", "--head-dim", "16"]
SUFFIX_HELP = "takes K = 1,024 and M = 1,000,000"


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "COLUMNS")}
    env.update(extra)
    return env


def _cli(*args, **env) -> subprocess.CompletedProcess:
    """``python -m tree_attn ARGS`` with stdout a pipe (not a terminal), stdin closed."""
    return subprocess.run([sys.executable, "-m", "tree_attn", *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, env=_env(**env), timeout=240, check=False)


# -- run --seq-len 0 ------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["0", "-1"])
def test_run_refuses_an_empty_cache_naming_the_option(capsys, value):
    assert main(["run", "--device", "cpu", "-n", value]) == 1
    err = capsys.readouterr().err
    assert f"--seq-len must be at least 1 token; got {value}" in err and "Traceback" not in err


# -- one count syntax for every count option, one exit code for a bad one -----------------------

class _Planned(Exception):
    """Raised by a stand-in planner: the options were parsed, nothing runs."""


# (command, option, where the stand-in finds the parsed value)
COUNT_OPTIONS = [
    ("run", "--seq-len", "seq_len"), ("run", "--batch", "batch"), ("run", "--sweep", "sweep"),
    ("tune", "--batch", "batch"),
    ("simulate", "--seq-lens", "seq_lens"), ("simulate", "--batch", "batch"),
    ("generate", "--prompt-len", "prompt_len"), ("generate", "--new-tokens", "new_tokens"),
    ("generate", "--max-len", "max_len"), ("generate", "--page-size", "page_size"),
    ("fit", "--new-tokens", "new_tokens"),
]


@pytest.fixture
def planned(monkeypatch, capsys):
    """Stand-ins for each command's planner: they record what the command parsed and stop."""
    import tree_attn.commands.fit as fit_command
    import tree_attn.commands.generate.setup as generate_setup
    import tree_attn.commands.run.setup as run_setup
    import tree_attn.commands.tune.setup as tune_setup
    from tree_attn.commands.run import sweep

    seen: dict = {}

    def record(options, sweep_text=None, **_):
        seen.update({f: getattr(options, f) for f in options.__dataclass_fields__})
        if sweep_text is not None:
            seen["sweep"] = sweep.sweep_lengths(sweep_text, 0)
        raise _Planned

    monkeypatch.setattr(run_setup, "plan_run", record)
    monkeypatch.setattr(sweep, "run_sweep", lambda options, text, progress=None: record(options, text))
    monkeypatch.setattr(tune_setup, "plan_tune", record)
    monkeypatch.setattr(generate_setup, "plan_generate", record)
    monkeypatch.setattr(fit_command, "fit", record)

    def parse(cmd: str, option: str, value: str) -> dict:
        seen.clear()
        if cmd == "simulate":  # nothing to stop: the model itself runs in a moment and reports both
            assert main([cmd, "-w", "8", option, value, "--json"]) == 0
            d = json.loads(capsys.readouterr().out)
            return {"seq_lens": sorted({r["seq_len"] for r in d["rows"]}), "batch": d["workload"]["batch"]}
        with pytest.raises(_Planned):
            main([cmd, option, value])
        return seen

    return parse


@pytest.mark.parametrize("cmd, option, field", COUNT_OPTIONS, ids=lambda x: x if isinstance(x, str) else None)
def test_every_count_option_takes_k_and_m(planned, cmd, option, field):
    lists = option in ("--sweep", "--seq-lens")

    def value(parsed):
        return parsed[field]

    for text, n in (("64K", 65536), ("64k", 65536), ("2M", 2_000_000), ("5.12M", 5_120_000), ("300", 300)):
        assert value(planned(cmd, option, text)) == ([n] if lists else n), (cmd, option, text)
    if lists:
        assert value(planned(cmd, option, "16K,1m")) == [16384, 1_000_000]


@pytest.mark.parametrize("cmd, option, field", COUNT_OPTIONS, ids=lambda x: x if isinstance(x, str) else None)
@pytest.mark.parametrize("bad", ["64X", "0.3K", "1e6", "K"])
def test_a_value_that_is_not_a_count_is_exit_2_everywhere(capsys, cmd, option, field, bad):
    assert main([cmd, option, bad if option not in ("--sweep", "--seq-lens") else f"16K,{bad}"]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and option in lines[0] and repr(bad) in lines[0], err
    assert "unable to parse" not in err and "Traceback" not in err


def test_every_count_option_states_the_suffix_rule_once_and_no_other_does():
    stated = set()
    for name, command in cli_command().commands.items():
        for param in command.params:
            help_text = getattr(param, "help", None) or ""
            if help_text.count(SUFFIX_HELP):
                assert help_text.count(SUFFIX_HELP) == 1, (name, param.opts)
                stated.add((name, max(param.opts, key=len)))
    assert stated == {(c, o) for c, o, _ in COUNT_OPTIONS}


def test_run_help_shows_the_rule_beside_seq_len(capsys):
    assert main(["run", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "Total KV tokens, split over the ranks (at least 1); takes K = 1,024 and M = 1,000,000" in out


# -- check: the device model first ----------------------------------------------------------------

def test_check_reads_an_a100_against_an_h100_as_another_model_not_links_down(capsys):
    assert main(["check", "--expect", str(H100), "--from", str(A100)]) == 1
    out = capsys.readouterr().out
    assert "different GPU model" in out and "every GPU pair has NV12 where NV18 was expected" in out
    assert "down" not in out.replace("not NVLinks down", "")
    assert "skip link classes: another device model" in out


def test_check_does_not_call_an_unnamed_h200_dump_as_expected(capsys):
    assert main(["check", "--expect", str(H100), "--from", str(H200)]) == 0  # nothing found to differ
    out = " ".join(capsys.readouterr().out.split())
    assert "the fabric is as expected" not in out
    assert "the links are as expected; the GPU model was not compared" in out and "nvidia-smi -L" in out


def test_check_of_unnamed_amd_dumps_names_the_amd_listing(tmp_path, capsys):
    """An MI300X dump names no GPU either; the advice was NVIDIA's (`nvidia-smi -L`, "a
    `nvidia-smi topo -m` dump"). The listing it names is one --from reads and that fills the names."""
    amd_smi, rocm_smi = FIX / "mi300x_8gpu_amd-smi_topology.txt", FIX / "mi300x_8gpu_rocm-smi_showtopo.txt"
    assert main(["check", "--expect", str(amd_smi), "--from", str(rocm_smi)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "nvidia-smi" not in out, out
    assert "(a `rocm-smi --showtopo` dump names none); add `rocm-smi --showproductname` output" in out
    listing = tmp_path / "showproductname.txt"
    listing.write_text("".join(f"GPU[{i}]\t\t: Card Series: \t\tAMD Instinct MI300X\n" for i in range(8)))
    expected = tmp_path / "expected.yaml"
    assert main(["probe", "--from", str(amd_smi), "--from", str(listing), "-o", str(expected)]) == 0
    assert main(["check", "--expect", str(expected), "--from", str(rocm_smi), "--from", str(listing)]) == 0
    assert "the fabric is as expected" in capsys.readouterr().out


def test_check_with_names_says_different_gpu_model(tmp_path, capsys):
    import dataclasses

    from tree_attn.topology import load_dump, save_topology

    def named(dump, name, path):
        topo = load_dump(dump)
        save_topology(topo.replace(devices=[dataclasses.replace(d, name=name) for d in topo.devices]), path)
        return path

    expected = named(H100, "NVIDIA H100 80GB HBM3", tmp_path / "h100.yaml")
    actual = named(H200, "NVIDIA H200", tmp_path / "h200.yaml")
    assert main(["check", "--expect", str(expected), "--from", str(actual), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["differences"] == [
        "different GPU model: expected NVIDIA H100 80GB HBM3, found NVIDIA H200 (all 8 GPUs)"]
    assert report["checks"][0]["name"] == "device model"
    assert main(["check", "--expect", str(expected), "--from", str(expected)]) == 0
    out = capsys.readouterr().out
    assert "device model: 8 compared, all NVIDIA H100 80GB HBM3" in out and "the fabric is as expected" in out


def test_check_on_a_host_without_gpu_says_so(tmp_path, monkeypatch, capsys):
    from tree_attn import topology
    from tree_attn.topology import host_topology, load_dump, save_topology

    remote = tmp_path / "remote.yaml"
    save_topology(load_dump(H100), remote)
    # This machine as a GPU-less host probes (whatever the machine running the test has).
    monkeypatch.setattr(topology, "probe_topology", lambda backend="auto", cpu_ranks=None: host_topology(
        cpu_ranks or 4, note="no GPU found (NVML: not found); using a host topology"))
    assert main(["check", "--expect", str(remote)]) == 1
    out = capsys.readouterr().out
    assert "this machine has no GPU" in out
    assert "missing" not in out and "expected 8 GPUs, found 4" not in out
    assert "skip device count: no GPU to compare" in out


# -- the built-in CPU profile's note names the kernel run uses --------------------------------------

def test_cpu_profile_note_names_the_kernel_that_run_reports(capsys):
    from tree_attn.kernels.cpu_native import ENV_SWITCH
    from tree_attn.profiles import load_builtin

    assert main(["run", "--device", "cpu", "-w", "2", "-n", "300", *SMALL, "--steps", "1", "--warmup", "0",
                 "-s", "tree", "--json"]) == 0
    ran = json.loads(capsys.readouterr().out)["local_kernel"]
    kind = ran.split(":")[0]  # "C kernel" or "torch ops"
    assert kind in ("C kernel", "torch ops")
    notes = load_builtin("cpu-4-ranks").notes
    assert not any("torch reference kernel" in n for n in notes)
    note = next(n for n in notes if n.startswith("CPU ranks run"))
    # The note names both: the C kernel first (what runs where a compiler is), and when torch ops run.
    assert "CPU ranks run the C decode kernel" in note and "torch ops" in note and ENV_SWITCH in note
    assert ("C decode kernel" if kind == "C kernel" else "torch ops") in note
    assert main(["profiles", "show", "cpu-4-ranks"]) == 0
    assert "CPU ranks run the C decode kernel" in " ".join(capsys.readouterr().out.split())


# -- paths and plan labels stay whole at 80 columns, piped ---------------------------------------

def _long_folder(tmp_path: Path) -> Path:
    folder = tmp_path / ("a-folder-with-a-long-name-" * 2) / "profiles-saved-by-tune-for-this-machine"
    folder.mkdir(parents=True)
    assert len(str(folder)) > 80
    return folder


def test_profiles_listing_keeps_paths_and_labels_whole_when_piped(tmp_path):
    from tree_attn.profiles import load_builtin, save_profile

    folder = _long_folder(tmp_path)
    saved = folder / "cpu.yaml"
    save_profile(load_builtin("cpu-4-ranks"), saved)
    proc = _cli("profiles", "--dir", str(folder), COLUMNS="80")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert f"    {saved}" in lines
    assert "    plan tree k=2 (default)" in lines
    for ln in lines:  # only lines that hold a path go past 80 columns
        assert len(ln) <= 80 or "/" in ln, ln
    empty = _cli("profiles", "--dir", str(tmp_path / "none"), COLUMNS="80")
    assert f"    {tmp_path / 'none'}" in empty.stdout.splitlines()


def test_profiles_show_takes_the_fingerprint_the_listing_prints(tmp_path, capsys):
    """The listing printed 8 of a fingerprint's 16 digits, which `profiles show` did not take."""
    from tree_attn.profiles import load_builtin, profile_path_for, save_profile

    prof = load_builtin("cpu-4-ranks")
    save_profile(prof, profile_path_for(prof.machine.fingerprint, tmp_path))
    assert main(["profiles", "--dir", str(tmp_path)]) == 0
    shown = re.findall(r"fingerprint (\w+)", capsys.readouterr().out)
    assert shown.count(prof.machine.fingerprint) == 2  # the built-in one and its saved copy
    assert main(["profiles", "show", prof.machine.fingerprint, "--dir", str(tmp_path)]) == 0
    assert f"fingerprint {prof.machine.fingerprint}" in capsys.readouterr().out


def test_a_table_wider_than_80_columns_keeps_every_cell_when_piped():
    """Piped, rich fits a table to 80 columns by cutting cells ("112.16 …" for a p95 in generate's
    table, "ran…" for a header here); every result table is printed whole instead."""
    proc = _cli("fit", "--preset", "llama-3.1-8b", "--memory", "1000TiB", COLUMNS="80")
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout, proc.stdout
    header = next(ln for ln in proc.stdout.splitlines() if "longest prompt" in ln)
    assert header.split() == ["ranks", "longest", "prompt", "per", "rank:", "weights", "KV", "activations", "process",
                              "total", "GiB"] and len(header) > 80
    assert "23,345.3" in proc.stdout


def test_tune_keeps_the_path_and_plan_labels_whole_when_piped(tmp_path):
    from tree_attn.profiles import load_profile

    out = _long_folder(tmp_path) / "dual-epyc.yaml"
    proc = _cli("tune", "--topology", str(RTX_DUAL), "-o", str(out), COLUMNS="80")
    assert proc.returncode == 0, proc.stderr
    prof = load_profile(out)
    assert f"profile written to {out} (plan: {prof.plan.label})" in proc.stdout.splitlines()
    for c in prof.reduction.candidates:
        assert any(c.label in ln for ln in proc.stdout.splitlines()), c.label


# -- progress counts to the end; rank 0's median is named as rank 0's ----------------------------

def test_progress_reaches_the_last_step_and_names_rank_0s_median():
    proc = _cli("run", "--device", "cpu", "-w", "2", "-n", "300", *SMALL, "--steps", "3", "--warmup", "0",
                "-s", "tree,ring")
    assert proc.returncode == 0, proc.stderr
    for label in ("tree k=2", "ring"):
        steps = re.findall(rf"\[rank 0\] {re.escape(label)}: step (\d+)/3", proc.stderr)
        assert steps == ["1", "2", "3"], proc.stderr
        assert f"[rank 0] {label}: rank 0's median step" in proc.stderr
    assert "(the table's median takes each step's slowest rank)" in proc.stderr


# -- the smaller points -----------------------------------------------------------------------------

def test_a_topology_given_as_a_profile_is_named_a_topology(tmp_path, capsys):
    from tree_attn.topology import load_dump, save_topology

    saved = tmp_path / "topo.yaml"
    save_topology(load_dump(H100), saved)
    for path in (saved, H100):
        assert main(["run", "--device", "cpu", "--profile", str(path)]) == 1
        err = capsys.readouterr().err
        assert "not a profile" in err and "tree-attn tune --topology" in err and "unknown key" not in err
    assert main(["profiles", "show", str(saved)]) == 1
    assert "this is a topology" in capsys.readouterr().err


def test_one_rank_reads_one_rank_without_a_fan_out(capsys):
    assert main(["run", "--device", "cpu", "-w", "1", "-n", "300", *SMALL, "--steps", "1", "--warmup", "0"]) == 0
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "1 ranks" not in text and "k=2" not in text
    assert "300 tokens on 1 rank" in captured.err and "strategies: tree, ring" in captured.err
    assert "300 tokens on 1 rank" in captured.out
    assert re.search(r"^ tree +eager", captured.out, re.MULTILINE)


def test_plot_without_sweep_is_refused(tmp_path, capsys):
    png = tmp_path / "x.png"
    assert main(["run", "--device", "cpu", "--plot", str(png)]) == 1
    err = capsys.readouterr().err
    assert "--plot draws step time against sequence length: give the lengths with --sweep" in err
    assert not png.exists()


def test_seq_len_beside_sweep_is_refused(capsys):
    """--sweep replaces --seq-len: a -n given beside it is refused, not dropped unseen."""
    assert main(["run", "--device", "cpu", "-n", "8K", "--sweep", "1K,2K"]) == 1
    err = capsys.readouterr().err
    assert "--seq-len 8,192 and --sweep both give the lengths" in err


def test_sweep_footnote_says_what_ring_over_x_is(capsys):
    from tree_attn.cli.run import render_sweep
    from tree_attn.commands.run.decode import RunResult, StrategyResult

    def row(name, ms):
        return StrategyResult(name, "tree k=2" if name == "tree" else name, ms, ms, 0, 0.0, 0, 0, 0, 0.0, 0.0, True)

    render_sweep([RunResult(spec={"world_size": 2, "seq_len": 1024}, device="cpu", backend="gloo",
                            results=[row("tree", 1.0), row("ring", 3.0)])])
    out = capsys.readouterr().out
    assert re.search(r"^ *1,024 +tree k=2 +1\.0 .* 3\.0 *$", out, re.MULTILINE), out  # ring 3 ms / tree 1 ms
    assert ("ring/x = ring's median step divided by this row's median step, at the same length (above 1: this "
            "row is faster than ring)") in " ".join(out.split())


def test_run_footnote_says_how_eager_rows_device_time_was_taken(capsys):
    """GPU rows: the footnote says what the device column is, and for eager rows (timed again,
    queued behind a spin kernel) where the JSON says how; no eager clause without such a row."""
    from tree_attn.cli.run import render_run
    from tree_attn.commands.run.decode import DEVICE_TIME_GRAPH, DEVICE_TIME_HELD, RunResult, StrategyResult

    def row(name, execution, how):
        return StrategyResult(name, name, 2.0, 2.5, 0, 0.0, 0, 0, 0, 0.0, 0.0, True, execution=execution,
                              device_ms_median=1.5, device_time=how)

    spec = {"world_size": 2, "seq_len": 1024}
    render_run(RunResult(spec=spec, device="GPU", backend="nccl",
                         results=[row("tree", "cuda graph", DEVICE_TIME_GRAPH),
                                  row("ring", "eager", DEVICE_TIME_HELD)]))
    out = " ".join(capsys.readouterr().out.split())
    assert ("device = CUDA-event time of the step (slowest rank); eager rows: extra steps queued behind a spin "
            "kernel (JSON device_time)") in out, out
    render_run(RunResult(spec=spec, device="GPU", backend="nccl",
                         results=[row("tree", "cuda graph", DEVICE_TIME_GRAPH)]))
    out = " ".join(capsys.readouterr().out.split())
    assert "device = CUDA-event time of the step (slowest rank)" in out and "eager rows" not in out


def test_subprocesses_keep_their_temporary_files_in_the_sessions_folder(_subprocess_tmpdir):
    # torchrun's agent writes a torchelastic_* folder under the temporary folder: the session's.
    proc = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
                          capture_output=True, text=True, env=_env(), timeout=60, check=False)
    assert proc.stdout.strip() == _subprocess_tmpdir
    assert os.environ["TMPDIR"] == _subprocess_tmpdir and os.path.isdir(_subprocess_tmpdir)
