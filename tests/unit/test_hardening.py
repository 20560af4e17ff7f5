"""Library-level hardening (issue "Hardening"): bad calls raise TreeAttnError subclasses with a
message, YAML anchors and aliases are refused, files get the umask's mode, sizes and torchrun
variables are checked before anything is built. Small and in-process."""

from __future__ import annotations

import os
import stat
import time

import pytest
import torch

import tree_attn
from tree_attn.errors import ConfigError, ShapeError, TreeAttnError
from tree_attn.files import YAMLAliasError, atomic_write_text, load_yaml, unwritable
from tree_attn.launch import env as launch
from tree_attn.launch import spawn
from tree_attn.topology import host_topology

Q = torch.randn(1, 4, 8)
K = torch.randn(1, 5, 2, 8)
POOL = torch.randn(3, 3, 2, 8)  # a paged pool: 3 blocks of 3 tokens

# (id, call, error class, text in the message)
LIBRARY_CASES = [
    ("head-dim-0",
     lambda: tree_attn.decode_attention(torch.randn(1, 4, 0), torch.randn(1, 5, 2, 0), torch.randn(1, 5, 2, 0)),
     ConfigError, "head dim"),
    ("complex-seq-lens", lambda: tree_attn.decode_attention(Q, K, K, seq_lens=torch.tensor([3 + 1j])), ShapeError,
     "integer tensor"),
    ("float-seq-lens", lambda: tree_attn.decode_attention(Q, K, K, seq_lens=torch.tensor([3.0])), ShapeError,
     "integer"),
    ("list-seq-lens", lambda: tree_attn.decode_attention(Q, K, K, seq_lens=[3]), ShapeError, "got list"),
    ("seq-lens-beyond-n", lambda: tree_attn.decode_attention(Q, K, K, seq_lens=torch.tensor([9])), ShapeError,
     "0..N=5"),
    ("list-q", lambda: tree_attn.decode_attention([1.0], K, K), ShapeError, "q must be a torch.Tensor"),
    ("int-q", lambda: tree_attn.decode_attention(Q.long(), K, K), ShapeError, "float16, bfloat16 or float32"),
    ("scale-text", lambda: tree_attn.decode_attention(Q, K, K, scale="a"), ConfigError, "scale must be"),
    ("scale-nan", lambda: tree_attn.decode_attention(Q, K, K, scale=float("nan")), ConfigError, "scale must be"),
    ("scale-inf", lambda: tree_attn.decode_attention(Q, K, K, scale=float("inf")), ConfigError, "scale must be"),
    ("scale-bool", lambda: tree_attn.decode_attention(Q, K, K, scale=True), ConfigError, "scale must be"),
    ("impl-unknown", lambda: tree_attn.decode_attention(Q, K, K, impl="cuda"), ConfigError, "impl must be one of"),
    ("merge-across-devices",
     lambda: tree_attn.merge_partials(torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 4, device="meta")),
     ShapeError, "one device"),
    ("merge-complex",
     lambda: tree_attn.merge_partials(torch.zeros(2, 1, 4, 8, dtype=torch.complex64), torch.zeros(2, 1, 4)),
     ShapeError, "floating-point"),
    ("merge-int-lse", lambda: tree_attn.merge_partials(torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 4, dtype=torch.long)),
     ShapeError, "floating-point"),
    ("merge-list", lambda: tree_attn.merge_partials([0.0], torch.zeros(2, 1, 4)), ShapeError, "torch.Tensor"),
    ("merge-shapes", lambda: tree_attn.merge_partials(torch.zeros(2, 1, 4, 8), torch.zeros(3, 1, 4)), ShapeError,
     "matching leading dims"),
    ("decode-step-complex-lens", lambda: tree_attn.DecodeStep(Q, K, K, torch.tensor([1 + 1j])), ShapeError, "integer"),
    ("tree-decode-without-a-group", lambda: tree_attn.tree_decode(Q, K, K), tree_attn.DistributedError,
     "not initialised"),
    # paged KV and several query tokens per row
    ("block-table-outside-pool",
     lambda: tree_attn.decode_attention(Q, POOL, POOL, seq_lens=torch.tensor([5]),
                                        block_table=torch.tensor([[0, 4]], dtype=torch.int32)),
     ShapeError, "block_table[0, 1] = 4 points outside the pool of 3 blocks"),
    ("block-table-negative",
     lambda: tree_attn.decode_attention(Q, POOL, POOL, seq_lens=torch.tensor([2]),
                                        block_table=torch.tensor([[-1, 0]], dtype=torch.int32)),
     ShapeError, "block_table[0, 0] = -1"),
    ("block-size-300",
     lambda: tree_attn.decode_attention(Q, torch.randn(2, 300, 2, 8), torch.randn(2, 300, 2, 8),
                                        seq_lens=torch.tensor([5]), block_table=torch.zeros(1, 1, dtype=torch.int32)),
     ConfigError, "block size 300"),
    ("paged-without-seq-lens",
     lambda: tree_attn.decode_attention(Q, POOL, POOL, block_table=torch.zeros(1, 2, dtype=torch.int32)),
     ShapeError, "needs seq_lens"),
    ("seventeen-query-tokens", lambda: tree_attn.decode_attention(torch.randn(1, 17, 4, 8), K, K), ShapeError, "Sq=17"),
    ("causal-not-a-bool", lambda: tree_attn.decode_attention(Q, K, K, causal=1), ConfigError,
     "causal must be True or False"),
    ("decode-step-table-outside-pool",
     lambda: tree_attn.DecodeStep(Q, POOL, POOL, torch.tensor([4]),
                                  block_table=torch.tensor([[2, 7]], dtype=torch.int32)),
     ShapeError, "block_table[0, 1] = 7"),
    ("launch-world-0", lambda: spawn.launch_ranks(print, 0), ConfigError, "at least 1"),
    ("launch-cpu-world-100000", lambda: spawn.launch_ranks(print, 100000), ConfigError, "at most"),
    ("launch-timeout-0", lambda: spawn.launch_ranks(print, 1, timeout_s=0), ConfigError, "timeout_s must be"),
    ("host-topology-100000", lambda: host_topology(100000), ConfigError, "at most"),
]


@pytest.mark.parametrize("call,kind,text", [c[1:] for c in LIBRARY_CASES], ids=[c[0] for c in LIBRARY_CASES])
def test_bad_library_calls_are_tree_attn_errors(call, kind, text):
    t0 = time.monotonic()
    with pytest.raises(kind, match=None) as info:
        call()
    assert isinstance(info.value, TreeAttnError) and text in str(info.value)
    assert time.monotonic() - t0 < 5


BOMB = ('a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]\n'
        + "".join(f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))
        + "name: *i\n")


def test_yaml_anchors_and_aliases_are_refused_at_once():
    t0 = time.monotonic()
    with pytest.raises(YAMLAliasError, match="anchor &a is not accepted") as info:
        load_yaml(BOMB)
    assert info.value.problem_mark.line == 0
    with pytest.raises(YAMLAliasError, match=r"alias \*x"):
        load_yaml("a: 1\nb: *x\n")
    assert time.monotonic() - t0 < 1
    assert load_yaml("a: [1, 2]\nb: {c: d}\n") == {"a": [1, 2], "b": {"c": "d"}}  # plain YAML as safe_load reads it


def test_an_alias_bomb_in_a_profile_or_topology_is_refused(tmp_path):
    from tree_attn.profiles import load_profile
    from tree_attn.topology import load_expected, load_topology

    path = tmp_path / "bomb.yaml"
    path.write_text("schema_version: 1\n" + BOMB)
    for load in (load_profile, load_topology, load_expected):
        with pytest.raises(TreeAttnError, match="anchor &a is not accepted"):
            load(path)


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_writes_honour_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
        atomic_write_text(tmp_path / "a.txt", "y")  # replacing keeps the umask's mode too
        atomic_write_text(tmp_path / "b.txt", "z", replace=False)
    finally:
        os.umask(old)
    for name in ("a.txt", "b.txt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode
    assert (tmp_path / "a.txt").read_text() == "y"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]  # no temporary file left


def test_atomic_write_without_replace_leaves_an_existing_file(tmp_path):
    target = tmp_path / "keep.txt"
    target.write_text("mine")
    with pytest.raises(FileExistsError):
        atomic_write_text(target, "theirs", replace=False)
    assert target.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_replacing_writes_through_a_symlink_and_refuses_what_is_not_a_file(tmp_path):
    real = tmp_path / "dotfiles" / "profile.yaml"
    real.parent.mkdir()
    real.write_text("old")
    link = tmp_path / "profile.yaml"
    link.symlink_to(real)
    atomic_write_text(link, "new")
    assert link.is_symlink() and real.read_text() == "new"  # the link stays, its target is replaced
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        atomic_write_text(fifo, "x")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    with pytest.raises(IsADirectoryError):
        atomic_write_text(tmp_path / "dotfiles", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dotfiles", "fifo.yaml", "profile.yaml"]


def test_unwritable_names_the_folder_that_decides(tmp_path):
    """What every output option checks before its work: missing folders will be created, so the
    nearest existing one decides (a file there, or a folder this user cannot write in)."""
    (tmp_path / "a-file").write_text("x")
    assert unwritable(tmp_path / "new" / "deeper" / "p.yaml") is None
    assert unwritable(tmp_path / "p.yaml") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # the test file and folder are gone
    assert unwritable(tmp_path / "a-file" / "p.yaml") == f"{tmp_path / 'a-file'} is a file, not a folder"
    assert unwritable(tmp_path) == "it is a folder, not a file"
    if os.geteuid() != 0:  # permission bits bind every user but root
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert unwritable(locked / "new" / "p.yaml").startswith(f"the folder {locked} cannot be written")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux procfs, which refuses new files to anyone")
def test_unwritable_asks_the_file_system_not_the_permission_bits():
    """procfs refuses a new file to every user, root included, though its permission bits say
    root may write there (``os.access`` is True): the check must say so before the work, not
    leave the write to fail after a tune or a measurement."""
    for path in ("/proc/tree-attn-profile.yaml", "/proc/new/deeper/tree-attn-profile.yaml"):
        problem = unwritable(path)
        assert problem is not None and problem.startswith("the folder /proc cannot be written"), (path, problem)


def test_cpu_rank_cap(monkeypatch):
    monkeypatch.setattr(launch, "usable_cores", lambda: 2)
    assert launch.max_cpu_ranks() == 8
    monkeypatch.setattr(launch, "usable_cores", lambda: 100)
    assert launch.max_cpu_ranks() == 64
    launch.check_cpu_ranks(64)
    with pytest.raises(ConfigError, match="use --world-size 64"):
        launch.check_cpu_ranks(65)


@pytest.mark.parametrize("env,text", [
    ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1 must lie in 0..WORLD_SIZE-1=1"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK='x'"),
])
def test_stale_torchrun_variables_name_the_variable(monkeypatch, env, text):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=None) as info:
        launch.torchrun_env("cpu")
    assert text in str(info.value)


def test_summarised_check_differences():
    from tree_attn.topology.compare import summarize_differences

    all_pairs = [f"GPU{a}-GPU{b}: expected NV18, found NV12" for a in range(4) for b in range(a + 1, 4)]
    assert summarize_differences(all_pairs, 6) == ["all 6 GPU pairs: expected NV18, found NV12"]
    one_gpu = [f"GPU{min(a, 5)}-GPU{max(a, 5)}: x" for a in (0, 1, 2, 3, 4, 6, 7)]
    assert summarize_differences(one_gpu, 28) == ["GPU5 with GPUs 0-4,6-7 (7 pairs): x"]
    few = ["GPU0-GPU1: x", "GPU2-GPU3: x", "expected 8 GPUs, found 7"]
    assert summarize_differences(few, 28) == few  # a few stay as they are


def test_topo_mp_dump_is_read_with_a_note():
    from pathlib import Path

    from tree_attn.topology import load_dump

    fix = Path(__file__).resolve().parents[1] / "fixtures" / "topology"
    assert any("topo -mp" in n for n in load_dump(fix / "dgx1_v100_8gpu_nvidia-smi_topo_mp.txt").notes)
    for name in ("a100_dgx_8gpu_12nic_nvidia-smi_topo_m.txt", "h100_8gpu_nonic_nvidia-smi_topo_m_thunderkittens167.txt",
                 "rtx4090_8gpu_dual_epyc7542_nvidia-smi_topo_m_whitespace_collapsed.txt"):
        assert not any("topo -mp" in n for n in load_dump(fix / name).notes), name
