"""`tree-attn simulate`, `run --sweep --plot` and `probe --plot` end to end: JSON, errors, pictures."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tree_attn.cli.app import main
from tree_attn.cost import preset
from tree_attn.cost.fit import cluster_to_dict

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "topology"
DGX1 = FIX / "dgx1_v100_8gpu_nvidia-smi_topo_mp.txt"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_simulate_json_rows_bytes_and_shapes(capsys):
    assert main(["simulate", "-w", "8,16,128", "-n", "32K,5.12M", "--heads", "16", "--kv-heads", "16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    rows = d["rows"]
    assert [(r["world_size"], r["nodes"], r["ranks_per_node"], r["seq_len"]) for r in rows] == [
        (8, 1, 8, 32768), (8, 1, 8, 5_120_000), (16, 2, 8, 32768), (16, 2, 8, 5_120_000),
        (128, 16, 8, 32768), (128, 16, 8, 5_120_000)]
    for w in (8, 16, 128):
        short, long = [r for r in rows if r["world_size"] == w]
        # The tree's bytes do not grow with the context; ring's grow linearly with it.
        assert short["tree"]["bytes_per_rank"] == long["tree"]["bytes_per_rank"]
        assert long["ring"]["bytes_per_rank"] > 100 * short["ring"]["bytes_per_rank"]
        assert long["speedup_ring_over_tree"] == pytest.approx(long["ring"]["time_us"] / long["tree"]["time_us"])
    assert rows[-1]["tree"]["plan"] == "hier nvlink>network k=2" and d["caveat"].startswith("predictions")
    assert d["cluster"]["network"]["kind"] == "network"


def test_simulate_kv_dtype_fp8_counts_one_byte_per_element_and_the_scales(capsys):
    """An fp8 cache: half bf16's shard bytes (the capacity arithmetic and the memory notes), and
    the ring's blocks at half their bytes plus their scales (float32 [2, Hkv], one more message
    each); the tree's messages are float32 states either way."""
    args = ["simulate", "-w", "8", "-n", "1M", "--json"]
    assert main([*args, "--dtype", "bf16"]) == 0
    bf16 = json.loads(capsys.readouterr().out)["rows"][0]
    assert main([*args, "--dtype", "bf16", "--kv-dtype", "fp8"]) == 0
    d = json.loads(capsys.readouterr().out)
    fp8 = d["rows"][0]
    assert d["workload"]["kv_dtype"] == "fp8"
    lengths = 4 * 7  # int32 [B] per block, 7 blocks forwarded
    scales = 2 * 8 * 4 * 7  # float32 [2, Hkv] per block
    assert fp8["ring"]["bytes_per_rank"] == (bf16["ring"]["bytes_per_rank"] - lengths) // 2 + lengths + scales
    assert fp8["ring"]["messages"] == bf16["ring"]["messages"] + 7
    assert fp8["tree"]["bytes_per_rank"] == bf16["tree"]["bytes_per_rank"]
    # A rank's shard (K and V, 125,000 tokens of 8 x 128): 1 byte per element instead of 2.
    assert bf16["tree"]["peak_mem_bytes"] - fp8["tree"]["peak_mem_bytes"] == 2 * 125_000 * 8 * 128
    assert main([*args[:-1], "--kv-dtype", "fp8"]) == 0
    assert "KV fp8" in " ".join(capsys.readouterr().out.split())


def test_simulate_table_fits_80_columns(capsys):
    assert main(["simulate", "--preset", "mi300x", "-w", "8,1024", "-n", "32K,10M"]) == 0
    out = capsys.readouterr().out
    assert "1024=128x8" in out and "10,000,000" in out
    assert max(len(line) for line in out.splitlines()) <= 80


@pytest.mark.parametrize("args, text", [
    (["-w", "12"], "world size 12 is not a whole number of nodes of 8"),
    (["-w", "5000"], "world size 5000: expected 1 to 4096"),
    (["-n", "0"], "sequence length '0': expected 1 to 100,000,000 tokens"),
    (["--preset", "dgx"], "unknown cluster preset 'dgx'"),
    (["--dtype", "int8"], "--dtype 'int8'"),
    (["--dtype", "float8_e4m3fn"], "--dtype 'float8_e4m3fn': expected fp32, fp16 or bf16"),
    (["--dtype", "fp8"], "give it as the KV dtype (--kv-dtype fp8)"),
    (["--kv-dtype", "int8"], "KV dtype must be one of"),
    (["--plot", "out.svg"], "give a file name ending in .png"),
    (["--step-overhead-us", "-5"], "--step-overhead-us must be a number of microseconds from 0 to 1e9"),
    (["-n", "200M"], "sequence length '200M': expected 1 to 100,000,000 tokens"),
    (["-g", "0"], "--gpus-per-node must be an integer in 1..4096; got 0"),
    (["-w", "8,16", "-k", "100"], "--fanout 100 is larger than the largest world size 16"),
    (["--profile", "h100-8x-nvswitch", "--topology", str(DGX1)],
     "give one source of parameters, not --profile and --topology"),
])
def test_simulate_bad_inputs_are_one_line(capsys, args, text):
    # (a length that is not a count, "32Q" or "0.3K", is the option parser's exit 2:
    # tests/cli/test_new_user.py checks that for every count option)
    assert main(["simulate", *args]) == 1
    err = capsys.readouterr().err
    assert text in err and "Traceback" not in err


def test_simulate_from_a_dump_and_from_a_parameters_file(capsys, tmp_path):
    assert main(["simulate", "--topology", str(DGX1), "-w", "8,16", "-n", "64K", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["rows"][1]["tree"]["plan"] == "hier pix>phb>sys>network k=2"
    assert "device from preset h100-sxm" in d["source"]
    assert main(["simulate", "--topology", str(DGX1), "-w", "4", "-g", "4"]) == 1  # the dump says 8 per node
    params = tmp_path / "params.json"
    params.write_text(json.dumps(cluster_to_dict(preset("rtx4090-pcie"))))
    assert main(["simulate", "--params", str(params), "-w", "8", "-n", "1M", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["source"] == f"parameters file {params}" and d["cluster"]["intra"]["kind"] == "pcie_host"


def test_simulate_reads_every_dtype_spelling(capsys):
    rows = {}
    for dtype in ("bf16", "BF16", "bfloat16", "torch.bfloat16"):
        assert main(["simulate", "--dtype", dtype, "-w", "8", "-n", "64K", "--json"]) == 0, capsys.readouterr().err
        rows[dtype] = json.loads(capsys.readouterr().out)["rows"]
    assert all(r == rows["bf16"] for r in rows.values())
    assert main(["simulate", "--dtype", "fp32", "-w", "8", "-n", "64K", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] != rows["bf16"]  # twice the KV bytes


def test_a_dump_naming_no_gpu_takes_the_device_of_the_preset_given(capsys):
    assert main(["simulate", "--topology", str(DGX1), "--preset", "rtx4090-pcie", "-w", "8", "-n", "64K",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert "device from preset rtx4090-pcie" in d["source"]
    assert d["cluster"]["device"] == cluster_to_dict(preset("rtx4090-pcie"))["device"]


def test_plots_without_matplotlib_say_how_to_install(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from tree_attn.cli.app import main\n"
            f"sys.exit(main(['simulate', '-w', '8', '--plot', {str(tmp_path / 'x.png')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1 and 'pip install matplotlib' in proc.stderr and 'pip install ".[plot]"' in proc.stderr
    assert not (tmp_path / "x.png").exists()


def test_simulate_and_probe_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    sim, topo = tmp_path / "sim.png", tmp_path / "topo.png"
    assert main(["simulate", "-w", "8,16,32", "-n", "32K,1M", "--plot", str(sim)]) == 0
    assert main(["probe", "--from", str(DGX1), "--plot", str(topo)]) == 0
    for p in (sim, topo):
        w, h = _png_size(p)
        assert w >= 400 and h >= 300 and p.stat().st_size < 200_000


@pytest.mark.slow
def test_run_sweep_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    assert main(["run", "--device", "cpu", "-w", "2", "--sweep", "1000,3001", "--heads", "4", "--kv-heads", "2",
                 "--head-dim", "16", "--steps", "1", "--warmup", "0", "-s", "tree,ring", "--json", "--plot",
                 str(png)]) == 0
    captured = capsys.readouterr()
    d = json.loads(captured.out)
    assert "note: --device cpu: spawning 2 CPU ranks" in captured.err  # as a run of one length says it
    assert [r["config"]["seq_len"] for r in d["sweep"]] == [1000, 3001]
    for res in d["sweep"]:
        assert {r["strategy"] for r in res["results"]} == {"tree", "ring"}
        assert all(r["max_abs_err"] < 1e-5 for r in res["results"])
    _png_size(png)
    assert main(["run", "--device", "cpu", "-w", "2", "--sweep", ",".join(str(1000 + i) for i in range(17))]) == 1


def test_simulate_from_a_profile(capsys):
    assert main(["simulate", "--profile", "mi300x-8x-xgmi", "-w", "8,16", "-n", "64K", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["source"] == "profile mi300x-8x-xgmi (builtin-model); network from preset mi300x"
    assert d["rows"][0]["tree"]["plan"] == "hier xgmi k=2" and d["cluster"]["network"]["p2p_gbps"] == 50.0
    assert main(["simulate", "--profile", "cpu-4-ranks", "-w", "4"]) == 1
    assert "calibrate_costmodel.py" in capsys.readouterr().err


def test_decimal_token_counts_are_exact(capsys):
    """4.1M is 4,100,000 tokens (a float product made it 4,099,999.99... and refused it)."""
    assert main(["simulate", "-w", "8", "-n", "4.1M,2.01M,8.2M,0.5K", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert sorted({r["seq_len"] for r in d["rows"]}) == [512, 2_010_000, 4_100_000, 8_200_000]


def test_an_amd_dump_takes_the_mi300x_preset_and_cpu_ranks_are_refused(capsys, tmp_path):
    mi300x = FIX / "mi300x_8gpu_amd-smi_topology.txt"
    assert main(["simulate", "--topology", str(mi300x), "-w", "8,16", "-n", "1M", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["cluster"]["device"]["name"] == "AMD Instinct MI300X"
    assert "network from preset mi300x" in d["source"] and d["rows"][0]["tree"]["plan"] == "hier xgmi k=2"
    cpu = tmp_path / "cpu4.yaml"
    assert main(["probe", "--backend", "host", "--cpu-ranks", "4", "-o", str(cpu)]) == 0
    capsys.readouterr()
    assert main(["simulate", "--topology", str(cpu), "-w", "4", "-n", "32K"]) == 1
    err = capsys.readouterr().err
    assert "CPU ranks" in err and "calibrate_costmodel.py" in err


def test_fewer_gpus_than_the_dump_keep_their_own_links(capsys):
    """GPUs 0 and 1 of a DGX-1 share a PCIe switch: two of them are priced on it, not across the sockets."""
    assert main(["simulate", "--topology", str(DGX1), "-w", "2,4", "-n", "32K", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows[0]["tree"]["plan"] == "hier pix k=2" and rows[1]["tree"]["plan"] == "hier pix>phb k=2"
    assert rows[0]["ring"]["time_us"] < rows[1]["ring"]["time_us"]


def test_memory_notes_say_which_strategy_does_not_fit(capsys):
    assert main(["simulate", "--preset", "rtx4090-pcie", "-w", "8,64", "-n", "1M,100M", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any(n.startswith("8 GPUs: from 100,000,000 tokens the KV shard alone (47.7 GiB") for n in notes), notes
    assert not any(n.startswith("64 GPUs") for n in notes)  # 6.0 GiB shards, 17.9 GiB with ring's two blocks
    assert main(["simulate", "--preset", "rtx4090-pcie", "-w", "16", "-n", "40M", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any(n.startswith("16 GPUs: ring's peak per rank (KV shard + 2 blocks in flight)") for n in notes), notes


def test_a_plot_path_that_cannot_be_written_is_refused_before_any_work(capsys, tmp_path):
    folder = tmp_path / "dir.png"
    folder.mkdir()
    assert main(["simulate", "-w", "8", "-n", "32K", "--plot", str(folder)]) == 1
    err = capsys.readouterr().err
    assert "is a folder" in err and "Traceback" not in err
    if os.path.isdir("/proc/self"):  # procfs refuses a new file to every user, root included
        assert main(["simulate", "-w", "8", "-n", "32K", "--plot", "/proc/x.png"]) == 1
        assert "the folder /proc cannot be written" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("x")  # was told "the folder .../a-file does not exist"
    assert main(["simulate", "-w", "8", "-n", "32K", "--plot", str(tmp_path / "a-file" / "x.png")]) == 1
    assert f"{tmp_path / 'a-file'} is a file, not a folder" in capsys.readouterr().err


def test_a_plot_is_drawn_after_the_results_and_a_failed_write_is_one_line(capsys, tmp_path, monkeypatch):
    """A picture that fails to write names its path in one line, after the table is printed."""
    pytest.importorskip("matplotlib")
    from tree_attn import files

    def full_disk(path, data, *, replace=True):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(files, "atomic_write_bytes", full_disk)
    out = tmp_path / "sim.png"
    assert main(["simulate", "-w", "8", "-n", "32K", "--json", "--plot", str(out)]) == 1
    cap = capsys.readouterr()
    assert json.loads(cap.out)["rows"]  # the predictions were printed first
    assert f"cannot write --plot {out}: No space left on device" in cap.err.replace("\n", "")
    assert not out.exists() and list(tmp_path.iterdir()) == []
