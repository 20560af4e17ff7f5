"""``tree-attn generate``: a real (tiny) model decoded with its KV cache paged and sharded over CPU
ranks gives exactly the greedy tokens of transformers alone; prefill, the paged shard and the
checks against float64; the CLI on a checkpoint folder with a tokenizer.

These tests mean CPU ranks (``device_kind="cpu"``, ``--device cpu``); the GPU one is marked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from tests.generate.checkpoints import transformers_greedy, write_checkpoint
from tests.torchrun import clean_env, run_nodes
from tree_attn.commands.generate.decode import (
    ONE_RANK,
    REFERENCE,
    GenerateSpec,
    ModelShape,
    decode_tokens,
    prefill,
    run_generate,
)
from tree_attn.commands.generate.hf_attention import (
    DecodeContext,
    attention_blockwise,
    attention_with_lse,
    use_tree_attention,
)
from tree_attn.commands.generate.kv_store import PagedKVShard
from tree_attn.commands.generate.models import ModelSource, build_model
from tree_attn.errors import ConfigError
from tree_attn.launch.setup import LaunchSetup
from tree_attn.reduce.plan import ReductionPlan

SMALL = ModelSource(preset="small", layers=2, seed=3)
TREE_AND_RING = (("tree", ReductionPlan("tree", 2)), ("ring", None))
HAS_GPU = torch.cuda.is_available()


def _prompt(n: int, vocab: int, seed: int = 1) -> tuple[int, ...]:
    return tuple(torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


@pytest.fixture(scope="module")
def small_model():
    return build_model(SMALL, dtype=torch.float32, device="cpu")


def _reference(source: ModelSource, prompt, n: int) -> list[int]:
    model = build_model(source, dtype=torch.float32, device="cpu")
    return transformers_greedy(model, list(prompt), n)


# -- the whole job on CPU ranks ---------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("world, strategies", [
    (2, (("tree", ReductionPlan("tree", 2)), ("ring", None))),
    (4, (("tree", ReductionPlan("tree", 2)), ("allreduce", ReductionPlan("allreduce")), ("ring", None))),
    (3, (("tree", ReductionPlan("tree", 3)),)),
])
def test_sharded_greedy_tokens_equal_transformers_alone(world, strategies, small_model):
    prompt = _prompt(301, 4096)
    expected = transformers_greedy(small_model, list(prompt), 32)
    assert len(set(expected)) > 8, "the reference must not be a repeated token, or the check proves little"
    spec = GenerateSpec(SMALL, prompt, LaunchSetup(world_size=world, plans=strategies, timeout_s=60.0), new_tokens=32)
    result = run_generate(spec)
    names = [r.name for r in result.rows]
    assert names[:2] == [REFERENCE, ONE_RANK] and len(names) == 2 + len(strategies)
    for row in result.rows:
        assert row.tokens == expected, row.name
        assert row.matches_reference and row.ranks_agree, row.name
        assert len(row.step_s) == 32 and all(t > 0 for t in row.step_s)
    assert result.all_match
    assert result.shard_sizes == spec.shard_sizes() and sum(result.shard_sizes) == 300
    # bytes per token: a tree sends one merge state per layer at most per rank, (Hq, D + 1) float32
    shape = ModelShape.from_config(small_model.config.to_dict())
    state = shape.q_heads * (shape.head_dim + 1) * 4
    tree = next(r for r in result.rows if r.name.startswith("tree"))
    assert tree.messages_per_token % shape.layers == 0 and tree.bytes_per_token == tree.messages_per_token * state
    if world == 2:
        assert tree.messages_per_token == shape.layers  # one state per layer each way
    ring = next((r for r in result.rows if r.name == "ring"), None)
    if ring is not None:  # ring moves KV pages: far more than the tree's states
        assert ring.bytes_per_token > 10 * tree.bytes_per_token


@pytest.mark.slow
def test_a_prompt_shorter_than_the_world_leaves_shards_empty(small_model):
    """A 3-token prompt over 4 ranks: prefill slices [1, 1, 0, 0], so two ranks start empty (the
    merge's identity) and only the last one grows; the tokens still equal transformers' alone."""
    prompt = _prompt(3, 4096, seed=9)
    launch = LaunchSetup(world_size=4, plans=(("tree", ReductionPlan("tree", 2)),), timeout_s=60.0)
    spec = GenerateSpec(SMALL, prompt, launch, new_tokens=12)
    assert spec.shard_sizes() == [1, 1, 0, 0]
    result = run_generate(spec)
    expected = transformers_greedy(small_model, list(prompt), 12)
    assert [r.tokens for r in result.rows] == [expected] * 3


def test_one_process_row_needs_the_whole_cache(small_model):
    """Negative control: the same decode with half of the prefill KV missing gives other tokens,
    so equal tokens are evidence, not an accident of the model."""
    prompt = _prompt(301, 4096)
    use_tree_attention(small_model)
    pre = prefill(small_model, list(prompt), 4096, lambda t: None)
    shape = ModelShape.from_config(small_model.config.to_dict())

    def decode(first_token: int) -> list[int]:
        store = PagedKVShard.allocate(shape.layers, 400, shape.kv_heads, shape.head_dim, dtype=torch.float32,
                                      device="cpu")
        keep = range(first_token, pre.length)
        for layer in range(shape.layers):
            store.write(layer, 0, *pre.tokens(layer, keep.start, keep.stop))
        store.set_length(len(keep))
        ctx = DecodeContext(store, "local", holds_new=True)
        return decode_tokens(small_model, ctx, prompt[-1], pre.length, 16, lambda t: None, "x").tokens

    whole = decode(0)
    assert whole == transformers_greedy(small_model, list(prompt), 16)
    assert decode(150) != whole


# -- where the work runs, transformers' cache API, the dtype default --------------------------------

def test_the_one_process_rows_run_in_a_child_process(tmp_path):
    """The launching process computes nothing: the prefill, the reference and the one-rank row
    run in a child (on a GPU machine, so the launcher makes no CUDA context on GPU 0); the child's
    progress reaches the caller, and the prefill it saves is what the ranks split."""
    from tree_attn.commands.generate.decode import PREFILL_FILE, decode_in_one_process, load_prefill

    prompt = _prompt(41, 4096, seed=4)
    spec = GenerateSpec(SMALL, prompt, LaunchSetup(world_size=2, plans=TREE_AND_RING, timeout_s=60.0), new_tokens=6)
    said = []
    local = decode_in_one_process(spec, str(tmp_path), said.append)
    assert local.pid != os.getpid()
    assert [r.name for r in local.rows] == [REFERENCE, ONE_RANK]
    assert local.rows[0].tokens == local.rows[1].tokens == local.reference and len(local.reference) == 6
    assert local.device.startswith("CPU") and local.prefill_s > 0
    assert any(m.startswith("prefill: 40/40") for m in said) and any(m.startswith(REFERENCE) for m in said)
    pre = load_prefill(str(tmp_path))
    shape = ModelShape.from_config(build_model(SMALL, dtype=torch.float32, device="cpu").config.to_dict())
    assert (tmp_path / PREFILL_FILE).is_file() and pre.length == 40 and len(pre.k) == shape.layers
    assert pre.k[0].shape == (shape.kv_heads, 40, shape.head_dim)


def test_generate_emits_no_future_warning(tmp_path):
    """transformers 5.24 renamed the forward's ``past_key_values=`` to ``cache=`` (the old name
    warns, and goes in 5.40): the child's whole work (load, prefill, reference through
    transformers' cache, one-rank row) runs here with every warning recorded."""
    import warnings

    from tree_attn.commands.generate.decode import one_process_work

    spec = GenerateSpec(SMALL, _prompt(21, 4096, seed=6), LaunchSetup(world_size=2, plans=TREE_AND_RING), new_tokens=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        local = one_process_work(spec, str(tmp_path), lambda t: None)
    assert local.rows[0].tokens == local.rows[1].tokens
    future = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not future, future


def test_the_transformers_pin_is_the_range_with_the_cache_api():
    """The ``models`` extra, the install hint and the run-time check agree on the first
    transformers whose models take ``cache=`` (an older one would pass it through ``**kwargs``
    unread, and the reference would decode without its cache)."""
    import inspect
    from pathlib import Path

    import transformers
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    from tree_attn.commands.generate import models

    assert "cache" in inspect.signature(LlamaForCausalLM.forward).parameters
    assert models.transformers_version(transformers.__version__) >= models.MIN_TRANSFORMERS
    assert models.transformers_version("5.25.0.dev0") == (5, 25) and models.transformers_version("x") == (0, 0)
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"transformers>=5.24,<6"' in pyproject and '"transformers>=5.24,<6"' in models.MODELS_EXTRA
    assert models.MIN_TRANSFORMERS == (5, 24)


def test_older_transformers_is_refused_naming_the_pin(monkeypatch):
    import transformers

    from tree_attn.commands.generate.models import require_transformers

    monkeypatch.setattr(transformers, "__version__", "5.23.1")
    with pytest.raises(ConfigError, match=r"needs transformers 5\.24 or newer; found 5\.23\.1.*transformers>=5\.24,<6"):
        require_transformers()


def test_dtype_default_is_bf16_on_gpus_float32_on_cpu(monkeypatch):
    """``--dtype auto`` (the default) resolves from the ranks' device: bf16 on GPUs (fp32 weights
    and the fp32 paged build, which spills registers, are not what a GPU user wants), float32 on
    CPU ranks. The GPU case runs here with one GPU made visible to the resolution only."""
    from tree_attn.commands.generate.setup import GenerateOptions, plan_generate
    from tree_attn.launch import env as launch
    from tree_attn.launch.setup import default_dtype

    assert (default_dtype("cuda"), default_dtype("cpu")) == ("bfloat16", "float32")
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    small = dict(layers=1, prompt_len=10, new_tokens=2)
    assert GenerateOptions().dtype == "auto"
    assert plan_generate(GenerateOptions(device="cpu", world_size=2, **small)).spec.dtype == "float32"
    monkeypatch.setattr(launch, "gpu_count", lambda: 1)
    on_gpu = plan_generate(GenerateOptions(**small))
    assert (on_gpu.spec.device_kind, on_gpu.spec.dtype) == ("cuda", "bfloat16")
    assert any("bfloat16: rounding may differ" in w for w in on_gpu.warnings)
    assert plan_generate(GenerateOptions(device="cpu", world_size=2, **small)).spec.dtype == "float32"
    assert plan_generate(GenerateOptions(dtype="fp32", **small)).spec.dtype == "float32"  # asked for: kept
    assert plan_generate(GenerateOptions(device="cpu", world_size=2, dtype="fp16", **small)).spec.dtype == "float16"


def test_generate_help_states_the_dtype_default():
    from typer.testing import CliRunner

    from tree_attn.cli.app import app

    out = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "300", "TERM": "dumb"}).output
    assert "auto (bf16 on GPUs, float32 on CPU ranks)" in " ".join(out.split())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
def test_generate_on_gpus_leaves_the_launching_process_without_cuda(tmp_path):
    """On a GPU: the launching process of ``generate`` (and of ``tune``'s kernel search) never
    initialises CUDA, so it holds no context on GPU 0 beside rank 0's."""
    script = (
        "import json, sys, torch\n"
        "from tree_attn.cli.app import main\n"
        "code = main(['generate', '--layers', '2', '--prompt-len', '200', '--new-tokens', '8', '-w', '1', '--json'])\n"
        "assert code in (0, 1), code  # 1: a bf16 near-tie flipped a token (the JSON says which row)\n"
        "assert not torch.cuda.is_initialized(), 'generate initialised CUDA in the launching process'\n"
        "from tree_attn.commands.tune.timing import TuneOptions, tune_kernels_in_child\n"
        "from tree_attn.launch.setup import LaunchSetup\n"
        "launch = LaunchSetup(world_size=1, device_kind='cuda', backend='nccl', dtype='bfloat16')\n"
        "options = TuneOptions(launch, q_heads=8, kv_heads=2, head_dim=64, quick=True, buckets=(1024,))\n"
        "rep = tune_kernels_in_child(options)\n"
        "assert rep.buckets and rep.buckets[0].chosen.median_us > 0\n"
        "assert not torch.cuda.is_initialized(), 'kernel tuning initialised CUDA in the launching process'\n"
    )
    env = {**os.environ, "TREE_ATTN_PROFILE_DIR": str(tmp_path / "profiles")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=400, env=env,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["dtype"] == "bfloat16" and result["device"] != "cpu"


# -- prefill and the paged shard against float64 ---------------------------------------------------

SHAPES = [(1, 1, True), (37, 37, True), (130, 130, True), (5, 200, False)]


# the prefill never asks for attention over no keys (a first chunk has no past); the portable path
# still gives the empty state for it
@pytest.mark.parametrize("path, s, n, causal", [("cpu-flash", *x) for x in SHAPES]
                         + [("blockwise", *x) for x in SHAPES + [(70, 0, False)]])
def test_prefill_attention_against_float64(path, s, n, causal):
    gen = torch.Generator().manual_seed(s * 1000 + n)
    q = torch.randn(8, s, 32, generator=gen)
    k, v = torch.randn(2, n, 32, generator=gen), torch.randn(2, n, 32, generator=gen)
    fn = attention_with_lse if path == "cpu-flash" else attention_blockwise
    out, lse = fn(q, k, v, 0.3, causal)
    scores = torch.einsum("hgsd,hnd->hgsn", q.double().view(2, 4, s, 32), k.double()) * 0.3
    if causal:
        scores = scores.masked_fill(torch.ones(s, n, dtype=torch.bool).triu(1), float("-inf"))
    ref_lse = torch.logsumexp(scores, -1)
    ref = torch.einsum("hgsn,hnd->hgsd", torch.softmax(scores, -1).nan_to_num(0.0), v.double())
    if n:
        torch.testing.assert_close(out.double(), ref.reshape(8, s, 32), atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(lse.double(), ref_lse.reshape(8, s), atol=2e-6, rtol=1e-5)
    else:
        assert torch.isneginf(lse).all()


def test_chunked_prefill_keeps_the_same_kv_as_one_chunk(small_model):
    use_tree_attention(small_model)
    prompt = list(_prompt(201, 4096, seed=5))
    one = prefill(small_model, prompt, 4096, lambda t: None)
    chunked = prefill(small_model, prompt, 37, lambda t: None)
    assert one.length == chunked.length == 200
    for layer in range(len(one.k)):
        # layer 1's K and V come through layer 0's attention: equal up to float32 rounding
        torch.testing.assert_close(chunked.k[layer], one.k[layer], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(chunked.v[layer], one.v[layer], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("page", [1, 5, 16, 256])
def test_paged_shard_round_trip(page):
    gen = torch.Generator().manual_seed(page)
    store = PagedKVShard.allocate(2, 75, 3, 8, dtype=torch.float32, device="cpu", page_size=page, seed=page)
    assert sorted(store.block_table[0].tolist()) == list(range(store.block_table.shape[1]))  # a permutation
    k, v = torch.randn(75, 3, 8, generator=gen), torch.randn(75, 3, 8, generator=gen)
    for layer in range(2):
        store.write(layer, 0, k[:40], v[:40])
        store.write(layer, 40, k[40:], v[40:])
    store.set_length(75)
    assert int(store.seq_lens) == 75
    rk, rv = store.read(1)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    with pytest.raises(ConfigError, match="KV shard full"):
        store.write(0, store.capacity, k[:1], v[:1])


# -- checkpoints: Llama with a tokenizer through the CLI, Qwen2 and Mistral -------------------------

@pytest.mark.slow
def test_cli_generates_text_from_a_llama_checkpoint(tmp_path):
    folder = write_checkpoint(tmp_path / "tiny-llama", "llama", tokenizer=True)
    prompt = "the tree attention model will merge the shard of each rank " * 12
    env = {**os.environ, "TREE_ATTN_PROFILE_DIR": str(tmp_path / "profiles")}
    proc = subprocess.run(
        # -W reaches the spawned processes too (multiprocessing passes the interpreter's flags on)
        [sys.executable, "-W", "error::FutureWarning", "-m", "tree_attn", "generate", "--model", str(folder),
         "--prompt", prompt, "-w", "2", "--device", "cpu", "--new-tokens", "32", "--json"],
        capture_output=True, text=True, timeout=240, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ids = tok.encode(prompt)
    assert result["prompt_tokens"] == len(ids) and result["random_weights"] is False
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    expected = transformers_greedy(model, ids, 32)
    assert result["all_match_reference"] is True
    for row in result["rows"]:
        assert row["tokens"] == expected, row["name"]
        assert row["text"] == tok.decode(expected)
    assert result["profile"]["chosen_by"] in ("default", "builtin", "saved")
    assert "[rank 0]" in proc.stderr and "prefill" in proc.stderr and "FutureWarning" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("model_type, extra", [("qwen2", {}), ("mistral", {"sliding_window": None})])
def test_qwen2_and_mistral_checkpoints(model_type, extra, tmp_path):
    folder = write_checkpoint(tmp_path / model_type, model_type, seed=7, **extra)
    source = ModelSource(path=str(folder))
    prompt = _prompt(150, 160, seed=2)
    expected = _reference(source, prompt, 16)
    launch = LaunchSetup(world_size=2, plans=(("tree", ReductionPlan("tree", 2)),), timeout_s=60.0)
    spec = GenerateSpec(source, prompt, launch, new_tokens=16, page_size=5)
    result = run_generate(spec)
    assert [r.tokens for r in result.rows] == [expected] * 3


# -- the CLI's verdict ------------------------------------------------------------------------------

def test_cli_exits_1_when_a_row_differs(monkeypatch, capsys):
    """The check behind exit 1: a result whose tree row lost a token is reported, not passed."""
    from tree_attn.cli.app import main
    from tree_attn.commands.generate import decode as gen

    def fake_run(spec, progress=None, tokenizer=None):
        rows = [gen.GenerateRow(REFERENCE, 1, [1, 2, 3], [0.01] * 3),
                gen.GenerateRow("tree k=2", 2, [1, 2, 4], [0.01] * 3, matches_reference=False)]
        return gen.GenerateResult("m", True, 10, 3, 2, "cpu", "gloo", "float32", 16, 0.1, rows, shard_sizes=[5, 4])

    monkeypatch.setattr(gen, "run_generate", fake_run)
    code = main(["generate", "--device", "cpu", "-w", "2", "--layers", "1", "--prompt-len", "10", "--new-tokens", "3"])
    err = capsys.readouterr().err
    assert code == 1
    assert "tree k=2: generated tokens differ from the reference" in err


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
def test_generate_on_gpus_equals_transformers():
    world = min(2, torch.cuda.device_count())
    prompt = _prompt(301, 4096)
    model = build_model(SMALL, dtype=torch.float32, device="cuda")
    expected = transformers_greedy(model, list(prompt), 32)
    launch = LaunchSetup(world_size=world, device_kind="cuda", backend="nccl", plans=TREE_AND_RING, timeout_s=120.0)
    spec = GenerateSpec(SMALL, prompt, launch, new_tokens=32)
    result = run_generate(spec)
    for row in result.rows:
        assert row.tokens == expected, row.name



# -- under torchrun: one node, and two "nodes" on loopback ------------------------------------------

def _clean_env(tmp_path) -> dict:
    env = clean_env(TREE_ATTN_PROFILE_DIR=str(tmp_path / "profiles"))
    return env


GEN_ARGS = ["generate", "--device", "cpu", "--layers", "2", "--seed", "3", "--prompt-len", "201", "--new-tokens", "16",
            "--timeout", "60", "--json"]


def _expected_for_cli_prompt() -> list[int]:
    """What the CLI's arguments above decode, from transformers alone."""
    from tree_attn.commands.generate.setup import parse_prompt

    model = build_model(SMALL, dtype=torch.float32, device="cpu")
    ids, _ = parse_prompt(None, 201, 4096, 3, None)
    return transformers_greedy(model, ids, 16)


@pytest.mark.slow
def test_generate_under_torchrun_joins_the_job(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "tree_attn", *GEN_ARGS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_clean_env(tmp_path), check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # only rank 0 prints
    assert proc.stderr.count("generating 16 tokens") == 1
    assert result["world_size"] == 2 and result["all_match_reference"] is True
    expected = _expected_for_cli_prompt()
    assert [r["name"] for r in result["rows"]] == [REFERENCE, ONE_RANK, "tree k=2", "ring"]
    assert all(r["tokens"] == expected for r in result["rows"])


@pytest.mark.slow
def test_generate_across_two_nodes_on_loopback(tmp_path):
    """2 torchrun "nodes" x 1 CPU rank (c10d rendezvous, gloo on loopback): the tree's one edge is
    the network level; every row gives transformers' tokens."""
    env = {**_clean_env(tmp_path), "GLOO_SOCKET_IFNAME": "lo"}
    outs = run_nodes(GEN_ARGS, nodes=2, per_node=1, env=env, cwd=tmp_path, timeout=180,
                     rdzv_id="tree-attn-generate-test")
    for code, _, err in outs:
        assert code == 0, err[-3000:]
    reports = [out for _, out, _ in outs if out.strip()]
    assert len(reports) == 1, outs  # the node that holds rank 0 reports
    result = json.loads(reports[0])
    assert result["world_size"] == 2 and result["all_match_reference"] is True
    assert "2 nodes x 1 ranks (torchrun)" in result["profile"]["text"]
    assert [r["name"] for r in result["rows"]] == [REFERENCE, ONE_RANK, "hier net k=2", "ring"]
    expected = _expected_for_cli_prompt()
    assert all(r["tokens"] == expected for r in result["rows"])
