"""Resolving `run` and `tune` options into a RunSpec / TuneSetup (commands.run.setup,
commands.tune.setup): devices, world size, dtype, plans, profile choice, output checks. Nothing is
launched here."""

from __future__ import annotations

from pathlib import Path

import pytest

from tree_attn.commands.run.setup import RunOptions, plan_run, strategies_beyond_tolerance
from tree_attn.commands.tune.setup import TuneRequest, plan_tune
from tree_attn.errors import ConfigError, ProfileError
from tree_attn.launch import env as launch
from tree_attn.launch.plans import ProfileChoice
from tree_attn.reduce.plan import ReductionPlan

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "topology"


@pytest.fixture(autouse=True)
def _not_under_torchrun(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def test_cpu_ranks_with_the_builtin_profile():
    setup = plan_run(RunOptions(device="cpu", world_size=4))
    spec = setup.spec
    assert (spec.device_kind, spec.backend, spec.world_size, spec.dtype) == ("cpu", "gloo", 4, "float32")
    assert setup.profile.chosen_by == "builtin" and setup.profile.name == "cpu-4-ranks"
    assert setup.profile.origin == "builtin-model" and setup.profile.path.endswith("cpu-4-ranks.yaml")
    assert set(setup.profile.to_dict()) == {"name", "origin", "path", "chosen_by", "text"}
    assert setup.notices == ("--device cpu: spawning 4 CPU ranks (gloo)",) and not setup.under_torchrun
    assert [name for name, _ in spec.plans] == ["tree", "ring"]


def test_defaults_without_a_profile_and_explicit_plans():
    setup = plan_run(RunOptions(device="cpu", world_size=3, strategy="tree,allreduce", fanout=3, dtype="bf16"))
    assert setup.profile == ProfileChoice(None, None, None, "default", setup.profile.text)
    assert "no profile for this machine" in setup.profile.text
    assert setup.spec.dtype == "bfloat16"
    assert setup.spec.plans == (("tree", ReductionPlan("tree", 3)), ("allreduce", ReductionPlan("allreduce")))


def test_gpu_ranks_by_default_when_torch_sees_gpus(monkeypatch):
    monkeypatch.setattr(launch, "gpu_count", lambda: 2)
    setup = plan_run(RunOptions())
    spec = setup.spec
    assert (spec.device_kind, spec.backend, spec.world_size, spec.dtype) == ("cuda", "nccl", 2, "bfloat16")
    assert setup.notices == ()
    assert setup.profile.chosen_by == "default"  # no 2-GPU profile exists (built-ins are 8 GPUs or CPU ranks)
    with pytest.raises(ConfigError, match="world size 3 is larger than the 2 GPUs"):
        plan_run(RunOptions(world_size=3))
    # --device cpu on a GPU host stays on CPU ranks
    assert plan_run(RunOptions(device="cpu")).spec.device_kind == "cpu"


def test_device_cuda_needs_a_visible_gpu(monkeypatch):
    monkeypatch.setattr(launch, "gpu_count", lambda: 0)
    with pytest.raises(ConfigError, match="no GPU is visible"):
        plan_run(RunOptions(device="cuda"))
    with pytest.raises(ConfigError, match="--device must be auto, cpu or cuda"):
        plan_run(RunOptions(device="gpu"))


def test_under_torchrun_the_world_is_torchruns(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # torchrun sets these too
    monkeypatch.setenv("MASTER_PORT", "29500")
    setup = plan_run(RunOptions(device="cpu"))
    assert setup.under_torchrun and setup.spec.world_size == 2 and setup.notices == ()
    assert setup.rank == 1  # only rank 0 prints the notices


def test_an_explicit_profile_for_another_machine_is_refused():
    with pytest.raises(ProfileError, match="another machine"):
        plan_run(RunOptions(device="cpu", world_size=2, profile="h100-8x-nvswitch"))


def test_tolerance_check_names_the_failing_strategies():
    from tree_attn.commands.run.decode import RunResult, StrategyResult

    def row(plan, err):
        return StrategyResult(plan, plan, 1.0, 1.0, 0, 0.0, 0, 0, 0, err, 0.0, True)

    result = RunResult(spec={}, device="cpu", backend="gloo",
                       results=[row("tree k=2", 1e-6), row("ring", 1e-3), row("allreduce", float("nan"))])
    assert strategies_beyond_tolerance(result, "float32") == ["ring", "allreduce"]
    assert strategies_beyond_tolerance(result, "bf16") == ["allreduce"]


# -- tune ------------------------------------------------------------------------------------------

def test_tune_cpu_ranks_is_measurable(tmp_path):
    setup = plan_tune(TuneRequest(device="cpu", world_size=3, output=str(tmp_path / "p.yaml")))
    assert setup.measurable and len(setup.topology) == 3
    assert (setup.options.device_kind, setup.options.backend, setup.options.dtype) == ("cpu", "gloo", "bfloat16")
    assert setup.notices[0] == "--device cpu: tuning for 3 CPU ranks (gloo)"
    from tree_attn.launch.env import usable_cores

    # more ranks than cores: said, with a world size that fits
    crowded = [n for n in setup.notices[1:] if "CPU ranks share" in n]
    assert len(crowded) == (1 if usable_cores() < 3 else 0)
    assert not crowded or crowded[0].endswith(f"-w {usable_cores()} gives steadier timings")


def test_tune_kv_dtype_reaches_the_kernel_timing_options(tmp_path):
    """``--kv-dtype fp8`` becomes TuneOptions.kv_dtype (the fp8 buckets the GPU search times) and
    the launch's KV dtype; without it both follow --dtype."""
    setup = plan_tune(TuneRequest(device="cpu", world_size=2, kv_dtype="fp8", output=str(tmp_path / "p.yaml")))
    assert setup.options.kv_dtype == "float8_e4m3fn" and setup.options.launch.kv_dtype == "float8_e4m3fn"
    assert setup.options.dtype == "bfloat16"
    dump = FIXTURES / "h100_sxm5_8gpu_1nic_vm_nvidia-smi_topo_m.txt"  # model-only: the launch is built directly
    model = plan_tune(TuneRequest(device="cpu", topology_file=str(dump), kv_dtype="e4m3",
                                  output=str(tmp_path / "h.yaml")))
    assert model.options.kv_dtype == "float8_e4m3fn" == model.options.launch.kv_dtype
    plain = plan_tune(TuneRequest(device="cpu", world_size=2, output=str(tmp_path / "q.yaml")))
    assert plain.options.kv_dtype is None and plain.options.launch.kv_dtype == "bfloat16"


def test_run_kv_dtype_resolves_into_the_launch():
    setup = plan_run(RunOptions(device="cpu", world_size=2, seq_len=64, dtype="fp32", kv_dtype="fp8"))
    assert (setup.spec.dtype, setup.spec.kv_dtype, setup.spec.made_dtype) == ("float32", "float8_e4m3fn", "float32")
    assert setup.spec.kv_bytes_per_rank() == 2 * 32 * 8 * 128 + 2 * 8 * 4
    assert plan_run(RunOptions(device="cpu", world_size=2, seq_len=64, dtype="fp16")).spec.kv_dtype == "float16"
    with pytest.raises(ConfigError, match="KV dtype must be one of"):
        plan_run(RunOptions(device="cpu", world_size=2, seq_len=64, kv_dtype="int8"))


def test_tune_checks_its_output_before_anything_else(tmp_path):
    out = tmp_path / "p.yaml"
    out.write_text("precious\n")
    with pytest.raises(ProfileError, match="already exists; pass --force"):
        plan_tune(TuneRequest(device="cpu", world_size=2, output=str(out)))
    assert plan_tune(TuneRequest(device="cpu", world_size=2, output=str(out), force=True)).force
    with pytest.raises(ProfileError, match="is a folder"):
        plan_tune(TuneRequest(device="cpu", world_size=2, output=str(tmp_path)))
    assert out.read_text() == "precious\n"


def test_tune_a_foreign_topology_is_model_only(tmp_path):
    dump = FIXTURES / "h100_sxm5_8gpu_1nic_vm_nvidia-smi_topo_m.txt"
    setup = plan_tune(TuneRequest(device="cpu", topology_file=str(dump), output=str(tmp_path / "h.yaml")))
    assert not setup.measurable and "CPU ranks" in setup.model_reason
    assert any("model-derived" in n for n in setup.notices)
    with pytest.raises(ConfigError, match="--world-size 4 does not match the topology's 8 devices"):
        plan_tune(TuneRequest(device="cpu", topology_file=str(dump), world_size=4, output=str(tmp_path / "h.yaml")))


def test_tune_more_gpus_than_torch_sees_is_model_only(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "gpu_count", lambda: 1)
    dump = FIXTURES / "h100_sxm5_8gpu_1nic_vm_nvidia-smi_topo_m.txt"
    setup = plan_tune(TuneRequest(topology_file=str(dump), output=str(tmp_path / "h.yaml")))
    assert setup.options.device_kind == "cuda" and setup.options.backend == "nccl"
    assert not setup.measurable and "torch sees 1" in setup.model_reason


def test_tune_bad_options(tmp_path):
    with pytest.raises(ConfigError, match="multiple of KV heads"):
        plan_tune(TuneRequest(device="cpu", heads=6, kv_heads=4))
    with pytest.raises(ConfigError, match="dtype must be one of"):
        plan_tune(TuneRequest(device="cpu", dtype="fp8"))


def test_profile_buckets_keep_how_the_kernel_search_chose():
    from tree_attn.commands.tune.profile import kernel_bucket
    from tree_attn.commands.tune.timing import BucketResult, KernelTiming
    from tree_attn.kernels.config import DecodeConfig

    cfg = DecodeConfig(block_n=64, num_splits=4)
    timing = KernelTiming(config=cfg, predicted_us=18.0, median_us=20.0, gbps=900.0, host_us=35.0,
                          copy_fraction=0.3, method="cuda-graph")
    base = dict(dtype="bfloat16", head_dim=128, group=4, max_shard_len=16384, timings=[timing] * 3, chosen=timing)
    measured = kernel_bucket(BucketResult(**base, copy_gbps=3000.0))
    assert ((measured.chosen_by, measured.time_us, measured.gbps, measured.candidates_tried)
            == ("measured", 20.0, 900.0, 3))
    assert (measured.copy_fraction, measured.host_us, measured.timing) == (0.3, 35.0, "cuda-graph")
    model = kernel_bucket(BucketResult(**base, chosen_by="model"))  # every timing host-bound
    assert (model.chosen_by, model.time_us, model.gbps, model.predicted_us) == ("model", None, None, 18.0)
    assert model.copy_fraction is None and model.timing is None
