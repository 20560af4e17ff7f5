"""The kernel search of ``tree-attn tune`` (model ranking, pruning, timing, choice) with tiny
shapes, and a profile's configs reaching the kernel.

It runs where this process runs Triton (see tests/conftest.py): compiled on the GPU when there is
one (the path `tune` takes on GPU ranks), else on CPU tensors under Triton's interpreter.
"""

import pytest
import torch

from tests.tolerances import assert_decode_close, tol_for
from tree_attn import decode_attention
from tree_attn.commands.tune.timing import TuneOptions, tune_kernels
from tree_attn.kernels.config import DecodeConfig
from tree_attn.kernels.reference import decode_attention_float64
from tree_attn.launch.setup import LaunchSetup

pytest.importorskip("triton")


def _tuning_device(device: torch.device) -> str:
    return "cuda:0" if device.type == "cuda" else "cpu"


def test_kernel_search_times_the_models_survivors_and_keeps_the_fastest(device):
    options = TuneOptions(LaunchSetup(world_size=1, device_kind=device.type, dtype="float32"),
                          q_heads=4, kv_heads=2, head_dim=16, quick=True, buckets=(64, 256))
    messages = []
    results = tune_kernels(options, progress=messages.append, device=_tuning_device(device))
    assert [r.max_shard_len for r in results] == [64, 256]
    for r in results:
        assert len(r.timings) == options.kernel_survivors
        assert all(t.median_us > 0 and t.gbps > 0 for t in r.timings)
        # the fastest timing that measured the kernel (not the host's issue time) wins
        trusted = [t for t in r.timings if not t.host_bound]
        assert r.chosen == (min(trusted, key=lambda t: t.median_us) if trusted else r.timings[0])
        # the survivors are the model's best, in the model's order
        predicted = [t.predicted_us for t in r.timings]
        assert predicted == sorted(predicted)
        assert r.group == 2 and r.head_dim == 16
        # how each time was taken: graph replays on GPUs (device time, never host-bound), the
        # host clock under the interpreter; GPUs also relate the bandwidth to a measured copy
        if device.type == "cuda":
            assert all(t.method == "cuda-graph" and not t.host_bound for t in r.timings), r.timings
            assert r.copy_gbps > 0 and all(0 < t.copy_fraction for t in r.timings)
            assert all(t.host_us > 0 for t in r.timings)
        else:
            assert all(t.method == "host-clock" and t.copy_fraction is None for t in r.timings)
    per_bucket = [m for m in messages if m.startswith("kernel bucket")]  # GPUs may also report a copy bandwidth
    assert len(per_bucket) == 2 and "64 tokens" in per_bucket[0]


def test_a_config_that_cannot_run_here_is_skipped_not_fatal(device, monkeypatch):
    """A candidate Triton cannot build on this device (out of shared memory, say: ConfigError) is
    recorded with its error and skipped; the bucket is decided among the others. Only when no
    candidate can run does the search stop, with the reason."""
    from tree_attn.errors import ConfigError
    from tree_attn.kernels import triton_launch

    real = triton_launch.TritonDecodeLaunch
    refused = []

    def launch(q, k, v, seq_lens, *, config=None, **kw):
        if not refused or config == refused[0]:
            refused[:1] = [config]
            raise ConfigError(f"config {config.describe()} needs more shared memory than this device has")
        return real(q, k, v, seq_lens, config=config, **kw)

    monkeypatch.setattr(triton_launch, "TritonDecodeLaunch", launch)
    options = TuneOptions(LaunchSetup(world_size=1, device_kind=device.type, dtype="float32"),
                          q_heads=4, kv_heads=2, head_dim=16, quick=True, buckets=(64,))
    messages = []
    (r,) = tune_kernels(options, progress=messages.append, device=_tuning_device(device))
    failed = [t for t in r.timings if t.error is not None]
    assert [t.config for t in failed] == refused and "shared memory" in failed[0].error
    assert failed[0].median_us is None and r.chosen.error is None and r.chosen.median_us > 0
    assert any("could not run here" in m for m in messages)

    monkeypatch.setattr(triton_launch, "TritonDecodeLaunch", lambda *a, config=None, **kw: (_ for _ in ()).throw(
        ConfigError("no shared memory at all")))
    with pytest.raises(ConfigError, match="none of the 3 candidate configs could run.*no shared memory at all"):
        tune_kernels(options, device=_tuning_device(device))


def test_kernel_search_runs_in_a_child_process(device):
    """``tune`` times kernel configs in a child process (on a GPU machine: the launching process
    then holds no CUDA context on GPU 0, where rank 0 runs next); its progress reaches the caller
    as it comes and its results are what tune_kernels returns."""
    import os

    from tree_attn.commands.tune.timing import tune_kernels_in_child

    options = TuneOptions(LaunchSetup(world_size=1, device_kind=device.type, dtype="float32"),
                          q_heads=4, kv_heads=2, head_dim=16, quick=True, buckets=(64,))
    messages = []
    report = tune_kernels_in_child(options, progress=messages.append, device=_tuning_device(device))
    assert report.pid != os.getpid()
    (r,) = report.buckets
    assert r.max_shard_len == 64 and len(r.timings) == options.kernel_survivors
    assert r.chosen in r.timings and r.chosen.median_us > 0
    assert any(m.startswith("kernel bucket 64 tokens: best") for m in messages), messages


def test_the_timed_configs_span_split_counts_and_include_the_default():
    """The model's time saturates (dozens of configs tie, one split count): the survivors must
    still cover several split counts, and the default config (what runs without a profile)."""
    from tree_attn.cost.devices import KNOWN_DEVICES
    from tree_attn.cost.kernel import (
        RankedConfig,
        candidate_configs,
        predict_time_us,
        rank_candidates,
        tuning_survivors,
    )
    from tree_attn.kernels.config import default_config
    from tree_attn.kernels.shapes import DecodeShape

    spec = KNOWN_DEVICES["h100-sxm"]
    for n in (4096, 65536, 1 << 20):
        shape = DecodeShape(1, 32, 8, 128, n)
        ranked = rank_candidates(candidate_configs(shape, torch.bfloat16, spec), shape, torch.bfloat16, spec)
        assert len({r.config.num_splits for r in ranked[:8]}) == 1  # what a plain top-8 would time
        default = default_config(shape, torch.bfloat16, spec)
        include = RankedConfig(default, predict_time_us(default, shape, torch.bfloat16, spec))
        for k in (3, 8):
            chosen = tuning_survivors(ranked, k, include)
            assert len(chosen) == k and len({r.config for r in chosen}) == k
            assert default in [r.config for r in chosen]
            assert len({r.config.num_splits for r in chosen}) >= min(3, k)
            assert [r.predicted_us for r in chosen] == sorted(r.predicted_us for r in chosen)
            assert all(r.predicted_us <= 1.5 * ranked[0].predicted_us for r in chosen if r.config != default)
    assert tuning_survivors([], 3) == []


def test_kernel_search_is_skipped_on_cpu_ranks_by_default():
    options = TuneOptions(LaunchSetup(world_size=2))
    assert tune_kernels(options) == []


def test_a_chosen_config_computes_the_same_attention(device):
    options = TuneOptions(LaunchSetup(world_size=1, device_kind=device.type, dtype="float32"),
                          q_heads=8, kv_heads=2, head_dim=32, quick=True, buckets=(128,))
    (result,) = tune_kernels(options, device=_tuning_device(device))
    cfg = DecodeConfig.from_dict(result.chosen.config.to_dict())  # as stored in and read from a profile
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 32, generator=g)
    k = torch.randn(1, 100, 2, 32, generator=g)
    v = torch.randn(1, 100, 2, 32, generator=g)
    out, lse = decode_attention(q.to(device), k.to(device), v.to(device), impl="triton", config=cfg)
    ref_out, ref_lse = decode_attention_float64(q, k, v)
    assert_decode_close(out, lse, ref_out, ref_lse, tol_for(torch.float32, device=device), what=cfg.describe())
    assert (out.cpu().double() - ref_out).abs().max() < 1e-5
    assert (lse.cpu().double() - ref_lse).abs().max() < 1e-5


def test_timing_flags_a_host_bound_measurement():
    """A timing whose issue time reaches its device time measured Python: it must not rank configs."""
    from tree_attn.timing import CallTiming, rotation_count

    # Eager calls between events measure about max(device, host): a host-bound loop reads just
    # above its issue time, and that is what must be flagged.
    assert CallTiming(device_us=41.0, host_us=40.0, method="cuda-events", samples=3).host_bound
    assert CallTiming(device_us=5.0, host_us=40.0, method="cuda-events", samples=3).host_bound
    assert not CallTiming(device_us=60.0, host_us=40.0, method="cuda-events", samples=3).host_bound
    # issued while a spin kernel held the stream: the events saw device work only
    assert not CallTiming(device_us=5.0, host_us=40.0, method="cuda-events", samples=3, held=True).host_bound
    # replays: device time
    assert not CallTiming(device_us=5.0, host_us=40.0, method="cuda-graph", samples=3).host_bound
    # rotated inputs: 3x L2 (50 MiB) in 4 MiB inputs -> 39 + 1, capped by 40% of free memory and by `cap`
    assert rotation_count(4 << 20, 50 << 20, 10 << 30) == 39
    assert rotation_count(4 << 20, 50 << 20, 40 << 20) == 4
    assert rotation_count(1 << 30, 50 << 20, 80 << 30) == 2
    assert rotation_count(1 << 10, 50 << 20, 80 << 30, cap=256) == 256


def test_kernel_search_over_an_fp8_cache(device):
    """``tune`` with an fp8 KV cache: the bucket is the cache's dtype (the name profiles store), the
    timed configs come from the fp8 space and run over fp8 caches with scales (bandwidth counts 1
    byte per element), and the chosen config computes the attention of the dequantized cache."""
    from tests.fp8_inputs import dequantize, quantize
    from tree_attn.cost.kernel import kv_bytes
    from tree_attn.kernels.shapes import DecodeShape
    from tree_attn.kernels.triton_launch import decode_attention_triton, fp8_unsupported_reason

    if device.type == "cuda" and torch.version.hip is None:
        reason = fp8_unsupported_reason(torch.float8_e4m3fn, "cuda", torch.cuda.get_device_capability(device))
        if reason:
            pytest.skip(reason)
    options = TuneOptions(LaunchSetup(world_size=1, device_kind=device.type, dtype="bfloat16"), q_heads=8, kv_heads=2,
                          head_dim=32, kv_dtype="float8_e4m3fn", quick=True, buckets=(96,))
    (r,) = tune_kernels(options, device=_tuning_device(device))
    assert r.dtype == "float8_e4m3fn" and r.group == 4 and len(r.timings) == options.kernel_survivors
    fp8_bytes = kv_bytes(DecodeShape(1, 8, 2, 32, 96), torch.float8_e4m3fn)
    assert all(abs(t.gbps * t.median_us * 1e3 / fp8_bytes - 1) < 1e-9 for t in r.timings)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 8, 32, generator=g).to(torch.bfloat16)
    k8, ks = quantize(torch.randn(1, 90, 2, 32, generator=g))
    v8, vs = quantize(torch.randn(1, 90, 2, 32, generator=g))
    out, lse = decode_attention_triton(q.to(device), k8.to(device), v8.to(device), config=r.chosen.config,
                                       k_scale=ks.to(device), v_scale=vs.to(device))
    ref_out, ref_lse = decode_attention_float64(q.float(), dequantize(k8, ks).float(), dequantize(v8, vs).float())
    assert_decode_close(out, lse, ref_out, ref_lse, tol_for(torch.bfloat16, device=device),
                        what=r.chosen.config.describe())
