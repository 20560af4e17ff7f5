"""``tree-attn tune`` on CPU ranks writes a valid measured profile; ``run`` uses it; bad profiles
are refused with the field named and the existing file untouched."""

import json
from pathlib import Path

import pytest

from tree_attn.cli.app import main
from tree_attn.profiles import load_profile

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "topology"


@pytest.fixture
def profile_dir(tmp_path, monkeypatch):
    d = tmp_path / "profiles"
    monkeypatch.setenv("TREE_ATTN_PROFILE_DIR", str(d))
    return d


def _run_json(capsys, *args):
    code = main(["run", "--world-size", "3", "--seq-len", "600", "--heads", "8", "--kv-heads", "2",
                 "--head-dim", "16", "--steps", "2", "--warmup", "1", "--json", *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out), captured.err


def test_tune_quick_writes_a_measured_profile_that_run_uses(profile_dir, capsys):
    out = profile_dir / "mine.yaml"
    code = main(["tune", "--quick", "--world-size", "3", "--output", str(out), "--json"])
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
    fastest = min(profile.reduction.candidates, key=lambda c: c.median_us)
    assert profile.reduction.plan == fastest.plan  # rank 0's decision: the lowest median
    assert profile.machine.world_size == 3 and profile.machine.device_kind == "cpu"

    with_profile, err = _run_json(capsys, "--profile", str(out))
    assert f"using profile {profile.name}" in err
    tree_row = with_profile["results"][0]
    assert tree_row["plan"] == profile.reduction.plan.label
    without, err2 = _run_json(capsys, "--strategy", "tree,ring")
    # Same inputs, same exact attention, whichever plan merged it.
    assert tree_row["max_abs_err"] < 1e-5 and without["results"][0]["max_abs_err"] < 1e-5
    assert with_profile["config"]["seed"] == without["config"]["seed"]


def test_run_finds_the_profile_saved_for_this_machine(profile_dir, capsys):
    assert main(["tune", "--quick", "--world-size", "3"]) == 0
    capsys.readouterr()
    saved = list(profile_dir.glob("*.yaml"))
    assert len(saved) == 1
    report, err = _run_json(capsys)
    assert "using the profile saved for this machine" in err and str(saved[0]) in err


def test_without_a_profile_run_says_it_uses_defaults(profile_dir, capsys):
    report, err = _run_json(capsys)
    assert "no profile for this machine" in err and "tree-attn tune" in err
    assert report["results"][0]["plan"] == "tree k=2"


def test_tune_refuses_to_overwrite_without_force(profile_dir, capsys, tmp_path):
    out = tmp_path / "p.yaml"
    out.write_text("precious\n")
    code = main(["tune", "--quick", "--world-size", "2", "--output", str(out)])
    assert code == 1
    assert "--force" in capsys.readouterr().err
    assert out.read_text() == "precious\n"


def test_tune_from_a_foreign_topology_is_model_derived(profile_dir, capsys, tmp_path):
    out = tmp_path / "h100.yaml"
    dump = FIXTURES / "h100_sxm5_8gpu_1nic_vm_nvidia-smi_topo_m.txt"
    code = main(["tune", "--topology", str(dump), "--output", str(out)])
    captured = capsys.readouterr()
    if code != 0 and "device kind" in captured.err:
        pytest.fail(f"a topo -m dump without names must still tune model-only: {captured.err}")
    assert code == 0, captured.err
    profile = load_profile(out)
    assert profile.origin == "model" and profile.reduction.chosen_by == "model"
    assert profile.machine.world_size == 8
    assert "not measured" in " ".join(profile.notes)


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
    code = main(["run", "--world-size", "2", "--seq-len", "64", "--steps", "1", "--profile", str(bad)])
    err = capsys.readouterr().err
    assert code == 1 and field in err and "Traceback" not in err
    assert bad.read_text() == text


def test_run_refuses_a_profile_for_another_machine(profile_dir, capsys):
    code = main(["run", "--world-size", "2", "--seq-len", "64", "--steps", "1", "--profile", "h100-8x-nvswitch"])
    err = capsys.readouterr().err
    assert code == 1 and "another machine" in err and "tree-attn tune" in err


def test_every_rank_uses_rank_0s_plan():
    from tree_attn.reduce.hier_plan import candidate_plans
    from tree_attn.ranks.launch import launch_ranks
    from tree_attn.runner.tune import time_plans_rank

    cands = candidate_plans(3, [("node", [[0, 1], [2]]), ("sys", [[0, 1, 2]])])
    results = launch_ranks(time_plans_rank, 3, args=(cands, 1, 4, 8, 3, 1))
    assert len({r.chosen for r in results}) == 1
    assert [t.plan for t in results[0].timings] == cands


def test_run_takes_the_kernel_config_of_the_matching_shard_bucket():
    from tree_attn.cli.run import _kernel_config
    from tree_attn.profiles import load_builtin

    profile = load_builtin("h100-8x-nvswitch")
    got = _kernel_config(profile, "bfloat16", 32, 8, 128, 8 * 65536, 8)  # 64K tokens per rank
    cfg, chosen_by = profile.kernel_config_for("bfloat16", 128, 4, 65536)
    assert got == cfg.to_dict() and chosen_by == "model"
    assert _kernel_config(None, "bfloat16", 32, 8, 128, 1024, 8) is None
