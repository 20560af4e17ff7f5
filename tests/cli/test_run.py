"""``tree-attn run`` end to end at a small size, and its handling of bad input.

Tests of CPU ranks say ``--device cpu`` (on a GPU machine ``auto`` means the GPUs); the tests of
GPU ranks are marked ``gpu`` and use the GPUs there are.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tree_attn.cli.app import main

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_run_json_small(capsys):
    code = main(["run", "--device", "cpu", "--world-size", "3", "--seq-len", "1000", "--heads", "8", "--kv-heads", "2",
                 "--head-dim", "32", "--steps", "3", "--warmup", "1", "--strategy", "tree,allreduce,ring", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    rows = {r["strategy"]: r for r in report["results"]}
    assert set(rows) == {"tree", "allreduce", "ring"}
    for r in rows.values():
        for key in ("step_ms_median", "step_ms_p95", "bytes_sent_per_step", "peak_mem_bytes", "max_abs_err"):
            assert key in r
        assert r["max_abs_err"] < 1e-4
        assert r["step_ms_p95"] >= r["step_ms_median"] > 0
        assert r["peak_mem_bytes"] > 0
    # The tree broadcasts the root's bits; ring ranks merge blocks in different orders.
    assert rows["tree"]["ranks_agree"]
    # Per-step volumes: the tree's messages are one packed state [B, Hq, D + 1] float32 per edge;
    # ring forwards two whole KV shards (p - 1 = 2 steps) plus per-row lengths.
    state_bytes = 1 * 8 * (32 + 1) * 4
    assert rows["tree"]["bytes_sent_per_step"] == 2 * state_bytes  # the root sends down to 2 children
    kv_shard = 334 * 2 * 32 * 4  # the largest shard (1000 = 334 + 333 + 333 tokens), fp32 [1, n, 2, 32]
    assert rows["ring"]["bytes_sent_per_step"] >= 2 * 2 * 333 * 2 * 32 * 4
    assert rows["ring"]["bytes_sent_per_step"] <= 2 * 2 * kv_shard + 2 * 4 + 3 * 6 * 8
    assert report["config"]["shard_sizes"] == [334, 333, 333]
    assert report["speedup_vs_ring"] > 0 and report["compared"] == "tree k=2"  # the tree row, named
    # Which local attention the CPU ranks ran: this machine's C kernel, or the torch ops and why.
    from tree_attn.kernels.cpu_native import native_status

    status = native_status()
    assert report["local_kernel"] == status.describe()
    assert report["local_kernel"].startswith("C kernel: " if status.available else "torch ops: ")
    # CPU ranks: the prepared steps run eagerly and say why (CPU tensors, not a turned-off switch);
    # the ring baseline is always eager
    assert all(r["execution"] == "eager" and r["why_eager"] for r in rows.values())
    assert all("cpu tensors" in r["why_eager"] for name, r in rows.items() if name != "ring")
    assert all(r["device_ms_median"] is None for r in rows.values())
    assert "spawning 3 CPU ranks" in captured.err
    from tree_attn.launch.env import usable_cores

    if usable_cores() < 3:  # oversubscribed: said, with a world size that fits
        assert f"share {usable_cores()} core" in captured.err and f"-w {usable_cores()}" in captured.err
    # ring ranks may disagree in the last bits: when they do, the JSON says why
    assert rows["ring"]["ranks_agree"] or "different orders" in rows["ring"]["ranks_agree_note"]
    assert rows["tree"]["ranks_agree_note"] is None
    # which profile: structured, not a sentence (4 CPU ranks have a built-in one, 3 have none)
    assert report["profile"]["chosen_by"] == "default" and report["profile"]["name"] is None
    assert "no profile for this machine" in report["profile"]["text"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--heads", "6", "--kv-heads", "4"], "must be a multiple of KV heads"),
        (["--strategy", "butterfly"], "unknown strategy 'butterfly'"),
        (["--fanout", "1", "--strategy", "tree"], "fanout must be an integer >= 2"),
        (["--world-size", "2", "--fanout", "9", "--strategy", "tree"], "larger than the world size"),
        (["--device", "tpu"], "--device must be auto, cpu or cuda"),
        (["--dtype", "fp8"], "dtype must be one of"),
        (["--backend", "mpi"], "backend must be one of"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_1(capsys, args, message):
    device = [] if "--device" in args else ["--device", "cpu"]
    code = main(["run", *device, "--seq-len", "64", "--steps", "1", *args])
    captured = capsys.readouterr()
    assert code == 1
    assert message in captured.err
    assert "Traceback" not in captured.err


@pytest.mark.parametrize("world", ["100", "65"])
def test_too_many_cpu_ranks_names_the_limit_and_the_steadiest_count(capsys, world):
    """``-w 100`` on CPU ranks: the error gives the most this machine takes (an upper bound, not
    one count to use) and the steadiest count, one rank per core."""
    from tree_attn.launch.env import max_cpu_ranks, usable_cores

    limit, cores = max_cpu_ranks(), usable_cores()
    assert main(["run", "--device", "cpu", "-w", world, "--seq-len", "64", "--steps", "1"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"--world-size {world}: at most {limit} CPU ranks on this machine" in err, err
    assert (f"use --world-size {limit} or fewer (--world-size {min(limit, cores)}, one rank per core, gives the "
            "steadiest timings)") in err, err
    assert "Traceback" not in err


def test_device_cuda_without_a_visible_gpu_is_one_clear_line():
    # No GPU visible, on any machine: a fresh process with CUDA_VISIBLE_DEVICES="".
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "tree_attn", "run", "--device", "cuda", "--seq-len", "64", "--steps", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, check=False)
    assert proc.returncode == 1
    assert "no GPU is visible" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(N_GPUS == 0, reason="needs a GPU")
def test_world_size_beyond_the_gpus_is_one_clear_line(capsys):
    code = main(["run", "--device", "cuda", "--world-size", str(N_GPUS + 1), "--seq-len", "64", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 1 and f"larger than the {N_GPUS} GPUs" in err and "Traceback" not in err


def test_no_speedup_line_where_nothing_is_compared(capsys):
    """One rank sends nothing: no "faster than ring" line, no speedup in the JSON."""
    code = main(["run", "--device", "cpu", "-w", "1", "-n", "300", "--heads", "4", "--kv-heads", "2",
                 "--head-dim", "16", "--steps", "2", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report["speedup_vs_ring"] is None and report["compared"] is None


def test_debug_shows_traceback(capsys):
    code = main(["--debug", "run", "--device", "cpu", "--heads", "6", "--kv-heads", "4"])
    assert code == 1
    assert "Traceback" in capsys.readouterr().err


def test_help_explains():
    from typer.testing import CliRunner

    from tree_attn.cli.app import app

    result = CliRunner().invoke(app, ["run", "--help"])
    assert result.exit_code == 0
    assert "Ring" in result.output and "--fanout" in result.output


def test_run_under_torchrun_joins_the_job():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "tree_attn", "run",
           "--device", "cpu", "--seq-len", "500", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--steps",
           "2", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)  # only rank 0 prints
    assert proc.stderr.count("decoding B=") == 1  # the notices too, not once per rank
    assert report["config"]["world_size"] == 2
    assert {r["strategy"] for r in report["results"]} == {"tree", "ring"}
    assert all(r["max_abs_err"] < 1e-4 for r in report["results"])


def test_unknown_option_is_a_usage_error_not_a_traceback(capsys):
    code = main(["run", "--bogus"])
    err = capsys.readouterr().err
    assert code == 2 and "No such option" in err and "Traceback" not in err


@pytest.mark.gpu
@pytest.mark.skipif(N_GPUS == 0, reason="needs a GPU")
def test_run_on_the_gpus(capsys):
    """One rank per GPU there is (NCCL), the compiled kernel on each, every strategy exact."""
    code = main(["run", "--device", "cuda", "--seq-len", "20000", "--heads", "8", "--kv-heads", "2", "--head-dim", "64",
                 "--steps", "2", "--warmup", "1", "--strategy", "tree,allreduce,ring", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report["config"]["world_size"] == N_GPUS and report["config"]["device_kind"] == "cuda"
    assert report["config"]["dtype"] == "bfloat16" and report["backend"] == "nccl"
    assert {r["strategy"] for r in report["results"]} == {"tree", "allreduce", "ring"}
    assert all(r["max_abs_err"] < 2e-2 for r in report["results"])  # the bf16 limit of `run` itself
    rows = {r["strategy"]: r for r in report["results"]}
    # the tree and allreduce steps are replayed CUDA graphs; the ring baseline stays eager
    assert rows["tree"]["execution"] == rows["allreduce"]["execution"] == "cuda graph", rows
    assert rows["ring"]["execution"] == "eager"
    assert all(r["device_ms_median"] > 0 for r in rows.values())


@pytest.mark.gpu
@pytest.mark.skipif(N_GPUS == 0, reason="needs a GPU")
def test_run_on_the_gpus_without_graphs(capsys):
    code = main(["run", "--device", "cuda", "--seq-len", "5000", "--heads", "8", "--kv-heads", "2", "--head-dim", "64",
                 "--steps", "2", "--warmup", "1", "--strategy", "tree,allreduce", "--no-cuda-graph", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert all(r["execution"] == "eager" and "turned off" in r["why_eager"] for r in report["results"])
    assert all(r["max_abs_err"] < 2e-2 for r in report["results"])


def test_run_kv_dtype_fp8_json_reports_both_errors_and_ring_bytes(capsys):
    """``--kv-dtype fp8``: each rank quantizes its bf16 shard. max_abs_err is against float64 on
    the dequantized cache (held to bf16's limit), max_abs_err_unquantized against the bf16 cache
    (larger: the quantization's own error); the ring sends 1 byte per element plus 8 * Hkv bytes
    of scales per block, exactly."""
    code = main(["run", "--device", "cpu", "--world-size", "3", "--seq-len", "1000", "--heads", "8", "--kv-heads", "2",
                 "--head-dim", "32", "--steps", "2", "--warmup", "1", "--strategy", "tree,allreduce,ring",
                 "--dtype", "bf16", "--kv-dtype", "fp8", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    cfg = report["config"]
    assert cfg["dtype"] == "bfloat16" and cfg["kv_dtype"] == "float8_e4m3fn"
    assert cfg["kv_bytes_per_rank"] == 2 * 334 * 2 * 32 * 1 + 2 * 2 * 4  # K and V of the largest shard, and scales
    rows = {r["strategy"]: r for r in report["results"]}
    for r in rows.values():
        assert 0 < r["max_abs_err"] < 2e-2
        assert r["max_abs_err_unquantized"] is not None and r["max_abs_err_unquantized"] > r["max_abs_err"]
    # Rank r forwards the blocks of ranks r, r - 1 (1000 = 334 + 333 + 333): lengths int32 [1], K
    # and V at 1 byte per element, the scales float32 [2, 2]; the busiest rank is the one that
    # forwards the 334-token block.
    def per_block(n: int) -> int:
        return 4 + 2 * n * 2 * 32 + 2 * 2 * 4

    assert rows["ring"]["bytes_sent_per_step"] == per_block(334) + per_block(333)
    assert rows["ring"]["messages_per_step"] == 2 * 4
    # The tree's messages are float32 states, whatever the cache.
    assert rows["tree"]["bytes_sent_per_step"] == 2 * 8 * (32 + 1) * 4


def test_run_kv_dtype_fp8_table_has_both_error_columns(capsys):
    code = main(["run", "--device", "cpu", "--world-size", "2", "--seq-len", "300", "--heads", "4", "--kv-heads", "4",
                 "--head-dim", "16", "--steps", "1", "--warmup", "0", "--strategy", "tree", "--kv-dtype", "fp8"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = " ".join(captured.out.split())
    assert "max err" in out and "quant err" in out
    assert "the dequantized float8_e4m3fn cache" in out and "unquantized float32 cache" in out
    assert "(KV float8_e4m3fn:" in captured.err  # the announcement names the cache and its bytes per rank
