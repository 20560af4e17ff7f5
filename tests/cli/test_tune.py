"""``tree-attn tune`` on CPU ranks writes a valid measured profile; ``run`` uses it; bad profiles
are refused with the field named and the existing file untouched.

Tests of CPU ranks say ``--device cpu`` (on a GPU machine ``auto`` means the GPUs); the GPU test
is marked ``gpu`` and tunes the GPUs there are.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tree_attn.cli.app import main
from tree_attn.profiles import load_profile

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "topology"
N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture
def profile_dir(tmp_path, monkeypatch):
    # "[/x]" in the path: paths are printed through rich, which must not read them as markup.
    d = tmp_path / "cache[" / "x]profiles"
    monkeypatch.setenv("TREE_ATTN_PROFILE_DIR", str(d))
    return d


def _run_json(capsys, *args):
    code = main(["run", "--device", "cpu", "--world-size", "3", "--seq-len", "600", "--heads", "8", "--kv-heads", "2",
                 "--head-dim", "16", "--steps", "2", "--warmup", "1", "--json", *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out), captured.err


def test_tune_quick_writes_a_measured_profile_that_run_uses(profile_dir, capsys):
    out = profile_dir / "mine.yaml"
    code = main(["tune", "--device", "cpu", "--quick", "--world-size", "3", "--output", str(out), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report["profile_path"] == str(out)
    profile = load_profile(out)
    assert profile.origin == "measured" and profile.reduction.chosen_by == "measured"
    labels = [c.label for c in profile.reduction.candidates]
    assert "allreduce" in labels and "tree k=2" in labels
    assert all(c.median_us > 0 and c.p95_us >= c.median_us for c in profile.reduction.candidates)
    assert sum(c.selected for c in profile.reduction.candidates) == 1
    assert all(c.timing == "host-clock" for c in profile.reduction.candidates)  # CPU ranks: the host is the device
    fastest = min(profile.reduction.candidates, key=lambda c: c.median_us)
    assert profile.reduction.plan == fastest.plan  # rank 0's decision: the lowest median
    assert profile.machine.world_size == 3 and profile.machine.device_kind == "cpu"

    with_profile, err = _run_json(capsys, "--profile", str(out))
    assert f"using profile {profile.name}" in err
    assert {k: with_profile["profile"][k] for k in ("name", "origin", "path", "chosen_by")} == {
        "name": profile.name, "origin": "measured", "path": str(out), "chosen_by": "explicit"}
    tree_row = with_profile["results"][0]
    assert tree_row["plan"] == profile.reduction.plan.label
    without, _err2 = _run_json(capsys, "--strategy", "tree,ring")
    # Same inputs, same exact attention, whichever plan merged it.
    assert tree_row["max_abs_err"] < 1e-5 and without["results"][0]["max_abs_err"] < 1e-5
    assert with_profile["config"]["seed"] == without["config"]["seed"]


def test_run_finds_the_profile_saved_for_this_machine(profile_dir, capsys):
    assert main(["tune", "--device", "cpu", "--quick", "--world-size", "3"]) == 0
    captured = capsys.readouterr()
    assert "profile written to" in captured.out and "tuning for 3 CPU ranks" in captured.err
    saved = list(profile_dir.glob("*.yaml"))
    assert len(saved) == 1
    report, err = _run_json(capsys)
    assert "using the profile saved for this machine" in err and str(saved[0]) in err
    assert report["profile"]["chosen_by"] == "saved" and report["profile"]["path"] == str(saved[0])


def test_without_a_profile_run_says_it_uses_defaults(profile_dir, capsys):
    report, err = _run_json(capsys)
    assert "no profile for this machine" in err and "tree-attn tune" in err
    assert report["results"][0]["plan"] == "tree k=2"


def test_tune_refuses_to_overwrite_without_force_before_timing(profile_dir, capsys, tmp_path, monkeypatch):
    from tree_attn.commands.tune import timing as tune

    def no_timing(*args, **kwargs):
        raise AssertionError("tune timed plans although its output cannot be written")

    monkeypatch.setattr(tune, "tune_plans", no_timing)
    monkeypatch.setattr(tune, "tune_kernels", no_timing)
    monkeypatch.setattr(tune, "tune_kernels_in_child", no_timing)
    out = tmp_path / "p.yaml"
    out.write_text("precious\n")
    code = main(["tune", "--device", "cpu", "--quick", "--world-size", "2", "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 1
    assert "already exists" in err and "--force" in err and "Traceback" not in err
    assert out.read_text() == "precious\n"


def test_tune_device_option(capsys):
    assert main(["tune", "--device", "tpu"]) == 1
    assert "--device must be auto, cpu or cuda" in capsys.readouterr().err
    # No GPU visible, on any machine: a fresh process with CUDA_VISIBLE_DEVICES="".
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "tree_attn", "tune", "--device", "cuda", "--quick"],
                          capture_output=True, text=True, env=env, timeout=240, check=False)
    assert proc.returncode == 1
    assert "no GPU is visible" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("option, value", [("--head-dim", "0"), ("--head-dim", "-4"), ("--heads", "0"),
                                           ("--batch", "0"), ("--batch", "-1"), ("--kv-heads", "0")])
def test_tune_refuses_a_shape_that_is_not_one_naming_the_option(profile_dir, capsys, tmp_path, option, value):
    out = tmp_path / "p.yaml"
    dump = FIXTURES / "h100_sxm5_8gpu_1nic_vm_nvidia-smi_topo_m.txt"
    assert main(["tune", "--device", "cpu", "--topology", str(dump), "--output", str(out), option, value]) == 1
    err = capsys.readouterr().err
    assert f"{option} must be an integer >= 1; got {value}" in err and "Traceback" not in err
    assert not out.exists()


def test_tune_from_a_foreign_topology_is_model_derived(profile_dir, capsys, tmp_path):
    out = tmp_path / "h100.yaml"
    dump = FIXTURES / "h100_sxm5_8gpu_1nic_vm_nvidia-smi_topo_m.txt"
    # --device cpu: CPU ranks cannot time an 8-GPU fabric, on any machine (an 8-GPU host would time its own)
    code = main(["tune", "--device", "cpu", "--topology", str(dump), "--output", str(out)])
    captured = capsys.readouterr()
    if code != 0 and "device kind" in captured.err:
        pytest.fail(f"a topo -m dump without names must still tune model-only: {captured.err}")
    assert code == 0, captured.err
    profile = load_profile(out)
    assert profile.origin == "model" and profile.reduction.chosen_by == "model"
    assert profile.machine.world_size == 8
    assert "not measured" in " ".join(profile.notes)
    assert "model-derived" in captured.err


@pytest.mark.parametrize(
    "text,field",
    [
        ("schema_version: 1\nname: [unclosed\n", "not valid YAML"),
        ("schema_version: 99\n", "schema_version"),
        ("FANOUT", "reduction.plan.fanout"),
        ("UNKNOWN-KEY", "colour"),
    ],
)
def test_run_refuses_a_bad_profile_with_the_field_named(profile_dir, capsys, tmp_path, text, field):
    from tree_attn.profiles.builtin import builtin_path

    good = Path(builtin_path("cpu-4-ranks")).read_text()
    if text == "FANOUT":
        text = good.replace("fanout: 2", "fanout: 1", 1)
    elif text == "UNKNOWN-KEY":
        text = good + "colour: red\n"
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    code = main(["run", "--device", "cpu", "--world-size", "2", "--seq-len", "64", "--steps", "1", "--profile",
                 str(bad)])
    err = capsys.readouterr().err
    assert code == 1 and field in err and "Traceback" not in err
    assert bad.read_text() == text


def test_run_refuses_a_profile_for_another_machine(profile_dir, capsys):
    code = main(["run", "--device", "cpu", "--world-size", "2", "--seq-len", "64", "--steps", "1", "--profile",
                 "h100-8x-nvswitch"])
    err = capsys.readouterr().err
    assert code == 1 and "another machine" in err and "tree-attn tune" in err


def test_every_rank_uses_rank_0s_plan():
    """Plans are timed in batches of back-to-back iterations between barriers (the ranks' start
    skew counts once per batch, not once per iteration); every rank returns the same timings'
    plans and rank 0's choice, the plan of the lowest median."""
    from tree_attn.commands.tune.timing import time_plans_rank
    from tree_attn.launch.spawn import launch_ranks
    from tree_attn.reduce.hier_plan import candidate_plans

    cands = candidate_plans(3, [("node", [[0, 1], [2]]), ("sys", [[0, 1, 2]])])
    results = launch_ranks(time_plans_rank, 3, args=(cands, 1, 4, 8, 3, 4, 1))  # 3 batches of 4, 1 warm-up
    assert len({r.chosen for r in results}) == 1
    assert [t.plan for t in results[0].timings] == cands
    for t in results[0].timings:
        assert (t.iterations, t.per_batch, t.method) == (12, 4, "host-clock")
        assert 0 < t.median_us <= t.p95_us
    assert results[0].chosen == min(results[0].timings, key=lambda t: t.median_us).plan
    # the slowest rank's batch is every rank's sample: all ranks computed the same numbers
    assert all(r.timings == results[0].timings for r in results)


def test_plan_timing_batches():
    from tree_attn.commands.tune.timing import TuneOptions
    from tree_attn.launch.setup import LaunchSetup

    quick = TuneOptions(LaunchSetup(world_size=2), quick=True).plan_batches
    full = TuneOptions(LaunchSetup(world_size=2)).plan_batches
    assert quick == (8, 25, 3) and full == (25, 50, 20)  # skew counts 1/25 and 1/50 of itself


def test_run_takes_the_kernel_config_of_the_matching_shard_bucket():
    from tree_attn.launch.plans import kernel_config_for
    from tree_attn.profiles import load_builtin

    profile = load_builtin("h100-8x-nvswitch")
    got = kernel_config_for(profile, "bfloat16", 32, 8, 128, 8 * 65536, 8)  # 64K tokens per rank
    cfg, chosen_by = profile.kernel_config_for("bfloat16", 128, 4, 65536)
    assert got == cfg and chosen_by == "model"  # the config itself, as the ranks get it
    assert kernel_config_for(None, "bfloat16", 32, 8, 128, 1024, 8) is None


@pytest.mark.gpu
@pytest.mark.skipif(N_GPUS == 0, reason="needs a GPU")
def test_tune_the_gpus_then_run_under_the_profile(profile_dir, capsys, tmp_path):
    """On the GPUs there are: kernel configs timed per bucket and plans timed over NCCL, then a run
    of GPU ranks takes its plan and kernel config from the profile."""
    out = tmp_path / "gpu.yaml"
    code = main(["tune", "--device", "cuda", "--quick", "--output", str(out), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    profile = load_profile(out)
    assert profile.origin == "measured" and profile.machine.device_kind in ("cuda", "rocm")
    assert profile.machine.world_size == N_GPUS
    assert profile.kernel.buckets and all(b.candidates_tried >= 1 for b in profile.kernel.buckets)
    for b in profile.kernel.buckets:  # "model" where every timing was host-bound (see commands.tune.timing)
        assert (b.chosen_by == "measured" and b.time_us > 0) or (b.chosen_by == "model" and b.time_us is None)
    code = main(["run", "--device", "cuda", "--seq-len", "8192", "--steps", "2", "--warmup", "1", "--profile",
                 str(out), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report["profile"]["chosen_by"] == "explicit" and report["config"]["kernel_config"] is not None
    assert report["results"][0]["plan"] == profile.reduction.plan.label
