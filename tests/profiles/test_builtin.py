"""Built-in profiles: they load, validate, are model-derived, and equal the generator's output."""

from __future__ import annotations

import pytest

from tree_attn.errors import ProfileError
from tree_attn.profiles import (
    builtin_gen,
    builtin_profile_for,
    list_builtin_profiles,
    load_builtin,
    open_profile,
    profile_from_yaml,
)
from tree_attn.reduce.plan import default_plan
from tree_attn.topology import host_topology

EXPECTED = ["cpu-4-ranks", "h100-8x-nvswitch", "mi300x-8x-xgmi", "rtx4090-8x-pcie"]


def test_list():
    assert list_builtin_profiles() == EXPECTED


@pytest.mark.parametrize("name", EXPECTED)
def test_load_and_validate(name):
    p = load_builtin(name)
    assert p.name == name and p.origin == "builtin-model"
    assert p.reduction.chosen_by in ("model", "default")
    assert all(b.chosen_by == "model" and b.time_us is None and b.gbps is None for b in p.kernel.buckets)
    assert all(c.chosen_by == "model" and c.median_us is None for c in p.reduction.candidates)
    assert p.topology is not None and p.topology.fingerprint == p.machine.fingerprint
    p.plan.check(p.machine.world_size)
    assert profile_from_yaml(builtin_gen.profile_to_yaml(p)) == p


@pytest.mark.parametrize("name", ["h100-8x-nvswitch", "mi300x-8x-xgmi", "rtx4090-8x-pcie"])
def test_gpu_builtins_cover_llama_buckets(name):
    p = load_builtin(name)
    assert p.machine.world_size == 8
    assert [b.max_shard_len for b in p.kernel.buckets] == [8192 << i for i in range(8)]
    assert {(b.dtype, b.head_dim, b.group) for b in p.kernel.buckets} == {("bfloat16", 128, 4)}
    cfg, how = p.kernel_config_for("bf16", 128, 4, 100_000)
    assert how == "model" and cfg.num_splits is not None
    # The plan the model picked is the candidate it priced fastest.
    best = min(p.reduction.candidates, key=lambda c: c.predicted_us)
    assert best.selected and best.plan == p.plan


def test_cpu_builtin_is_the_binary_tree():
    p = load_builtin("cpu-4-ranks")
    assert p.machine.device_kind == "cpu" and p.machine.world_size == 4
    assert p.plan.tree(4).parent == default_plan(4).tree(4).parent
    assert p.kernel.buckets == []
    assert builtin_profile_for(host_topology(4)) == p
    assert builtin_profile_for(host_topology(3)) is None


def test_rtx4090_marks_p2p_as_model_derived():
    p = load_builtin("rtx4090-8x-pcie")
    assert p.machine.p2p == {"unsupported": 28}
    assert all("model-derived" in (l.p2p_reason or "") for l in p.topology.links)
    assert any("model-derived" in n for n in p.notes)


def test_shipped_files_equal_generator_output():
    files = builtin_gen.generate()
    assert sorted(files) == [f"{n}.yaml" for n in EXPECTED]
    for fname, text in files.items():
        shipped = (builtin_gen.BUILTIN_DIR / fname).read_text(encoding="utf-8")
        assert shipped == text, f"{fname} is stale: run `python -m tree_attn.profiles.builtin_gen` and commit"
    # Deterministic: a second run gives the same bytes.
    assert builtin_gen.generate() == files
    assert builtin_gen.main(["--check"]) == 0


def test_generator_check_reports_stale(tmp_path, capsys):
    assert builtin_gen.main(["--out", str(tmp_path)]) == 0
    assert builtin_gen.main(["--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "h100-8x-nvswitch.yaml").write_text("stale\n")
    assert builtin_gen.main(["--out", str(tmp_path), "--check"]) == 1
    assert "h100-8x-nvswitch.yaml" in capsys.readouterr().err


def test_no_machine_paths_in_shipped_files():
    root = str(builtin_gen.BUILTIN_DIR.parents[2])
    for fname in builtin_gen.generate():
        assert root not in (builtin_gen.BUILTIN_DIR / fname).read_text()


def test_unknown_builtin_and_open_profile(profile_dir):
    with pytest.raises(ProfileError, match="cpu-4-ranks"):
        load_builtin("nope")
    assert open_profile("h100-8x-nvswitch").name == "h100-8x-nvswitch"
    assert open_profile("builtin:cpu-4-ranks").name == "cpu-4-ranks"
    with pytest.raises(ProfileError, match="known profiles"):
        open_profile("nope")
