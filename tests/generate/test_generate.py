"""``tree-attn generate``: a real (tiny) model, its prompt prefilled sharded over CPU ranks (each
rank its zig-zag positions, every layer's K/V around the ring) and its KV cache paged there, gives
exactly the greedy tokens of transformers alone; the one-rank row is the same rank code at world
size 1; the reference is transformers' own prefill and cache; a broken rank changes the tokens;
the CLI on a checkpoint folder with a tokenizer, and under torchrun on one node and two.

These tests mean CPU ranks (``device_kind="cpu"``, ``--device cpu``); the GPU ones are marked.
Each spawned job costs seconds on two cores, so the cases are spread over few jobs: world sizes
2, 3, 4 and 5 over the Llama, Qwen2 and Mistral checkpoints and the preset.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.generate.checkpoints import transformers_greedy, write_checkpoint
from tests.generate.rank_fns import rank_with_flipped_keys
from tests.torchrun import clean_env, run_nodes
from tree_attn.commands.generate.decode import (
    LOCAL,
    ONE_RANK,
    REFERENCE,
    GenerateRow,
    GenerateSpec,
    ModelShape,
    _check,
    generate_rank,
    run_generate,
)
from tree_attn.commands.generate.kv_store import PagedKVShard
from tree_attn.commands.generate.memory import RowChoice
from tree_attn.commands.generate.models import ModelSource, build_model
from tree_attn.commands.generate.reference import reference_work
from tree_attn.errors import ConfigError
from tree_attn.launch.env import RankEnv
from tree_attn.launch.setup import LaunchSetup
from tree_attn.reduce.plan import ReductionPlan

SMALL = ModelSource(preset="small", layers=2, seed=3)
TREE = (("tree", ReductionPlan("tree", 2)),)
TREE_AND_RING = (("tree", ReductionPlan("tree", 2)), ("ring", None))
OFF = RowChoice(False, "skipped: --reference off")
HAS_GPU = torch.cuda.is_available()


def _prompt(n: int, vocab: int, seed: int = 1) -> tuple[int, ...]:
    return tuple(torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


@pytest.fixture(scope="module")
def small_model():
    return build_model(SMALL, dtype=torch.float32, device="cpu")


def _reference(source: ModelSource, prompt, n: int) -> list[int]:
    model = build_model(source, dtype=torch.float32, device="cpu")
    return transformers_greedy(model, list(prompt), n)


def _strategy_rows(result):
    return [r for r in result.rows if r.name not in (REFERENCE, ONE_RANK)]


# -- in this process: the one-rank row at world size 1 and the reference -----------------------------

def _one_rank_here(spec: GenerateSpec):
    """The one-rank row's rank code in this process: world size 1 makes no collective (the ring
    has no step to exchange, the local strategy none), so no process group is needed."""
    return generate_rank(RankEnv(0, 1, "gloo", "cpu", 0), spec, LOCAL)


def test_one_rank_row_and_reference_equal_transformers_alone(small_model):
    """World size 1 is the ordinary rank code (its sharded prefill a plain causal prefill); the
    reference row is transformers' own prefill and cache. Both give the tokens of transformers
    alone run by the test (the whole prompt in one forward), with no FutureWarning (transformers
    5.24 renamed ``past_key_values=`` to ``cache=``)."""
    import warnings

    prompt = _prompt(301, 4096)
    expected = transformers_greedy(small_model, list(prompt), 24)
    assert len(set(expected)) > 8, "the reference must not be a repeated token, or the check proves little"
    spec = GenerateSpec(SMALL, prompt, LaunchSetup(world_size=2, plans=TREE), new_tokens=24)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one = _one_rank_here(spec)
        ref = reference_work(spec, lambda t: None)
    assert one.runs[ONE_RANK].tokens == expected
    assert ref.tokens == expected and len(ref.step_s) == 24 and ref.pid == os.getpid()
    # each step's best logits, recorded for judging a row that parts from the reference (ties.py)
    assert len(ref.top) == 24 and [t.ids[0] for t in ref.top] == expected
    assert [t.ids[0] for t in one.runs[ONE_RANK].top] == expected  # rank 0 records its own, untimed
    assert all(abs(a - b) < 1e-3 for r, t in zip(ref.top, one.runs[ONE_RANK].top, strict=True)
               for a, b in zip(r.logits, t.logits, strict=True))
    assert all(len(t.ids) == 8 and list(t.logits) == sorted(t.logits, reverse=True) for t in ref.top)
    assert one.prefill.tokens == 300 and one.prefill.runs == [[0, 150], [150, 300]]  # chunks 0 and 1 of 2
    assert one.prefill.timing.stats.bytes_sent == 0 and one.prefill.timing.pairs == 2 * 300 * 301 // 2  # 2 layers
    future = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not future, future


def test_the_one_rank_row_needs_its_whole_prefill(small_model, monkeypatch):
    """Negative control in one process: the same decode with the prefill's keys flipped (each at
    another's position) gives other tokens, so equal tokens are evidence, not an accident."""
    from tree_attn.commands.generate import prefill

    prompt = _prompt(301, 4096)
    spec = GenerateSpec(SMALL, prompt, LaunchSetup(world_size=1, plans=TREE), new_tokens=16)
    whole = _one_rank_here(spec).runs[ONE_RANK].tokens
    attend = prefill.ShardedPrefill.attend
    monkeypatch.setattr(prefill.ShardedPrefill, "attend",
                        lambda self, layer, q, k, v, scale: attend(self, layer, q, k.flip(2), v, scale))
    assert _one_rank_here(spec).runs[ONE_RANK].tokens != whole


def test_a_broken_prefill_in_bf16_is_a_difference_not_a_near_tie(monkeypatch):
    """The near-tie rule (ties.py) must not excuse a real error: the same negative control in
    bf16, against the reference's recorded logits, parts at a token the rule refuses."""
    from tree_attn.commands.generate import prefill
    from tree_attn.commands.generate.ties import near_tie, parting

    prompt = _prompt(301, 4096)
    spec = GenerateSpec(SMALL, prompt, LaunchSetup(world_size=1, plans=TREE, dtype="bfloat16"), new_tokens=8)
    ref = reference_work(spec, lambda t: None)
    attend = prefill.ShardedPrefill.attend
    monkeypatch.setattr(prefill.ShardedPrefill, "attend",
                        lambda self, layer, q, k, v, scale: attend(self, layer, q, k.flip(2), v, scale))
    broken = _one_rank_here(spec).runs[ONE_RANK]
    assert broken.tokens != ref.tokens and len(broken.top) == 8
    assert near_tie(broken.tokens, ref.tokens, ref.top, torch.bfloat16, layers=2, own_top=broken.top) is None
    assert "a tie is within 11 ulps at 2 layers" in parting(broken.tokens, ref.tokens, ref.top, torch.bfloat16,
                                                             layers=2, own_top=broken.top)


def test_rows_are_checked_against_the_reference_else_one_rank_else_each_other():
    def rows(*named):
        return [GenerateRow(name, 1, list(tokens), [0.01] * len(tokens), skipped=None if tokens is not None else "x")
                if tokens is not None else GenerateRow(name, 1, [], [], skipped="skipped: x") for name, tokens in named]

    r = rows((REFERENCE, [1, 2]), (ONE_RANK, [1, 3]), ("tree k=2", [1, 2]))
    assert _check(r) == REFERENCE and [x.matches for x in r] == [True, False, True]
    r = rows((REFERENCE, None), (ONE_RANK, [1, 3]), ("tree k=2", [1, 2]))
    assert _check(r) == ONE_RANK and [x.matches for x in r if x.ran] == [True, False]
    r = rows((REFERENCE, None), (ONE_RANK, None), ("tree k=2", [1, 2]), ("ring", [1, 2]))
    assert _check(r) == "each other" and all(x.matches for x in r if x.ran)
    r = rows((REFERENCE, None), (ONE_RANK, None), ("tree k=2", [1, 2]), ("ring", [2, 2]))
    assert _check(r) == "each other" and [x.matches for x in r if x.ran] == [True, False]
    r = rows((REFERENCE, None), (ONE_RANK, None), ("tree k=2", [1, 2]))
    assert _check(r) == "nothing"


# -- the whole job on spawned CPU ranks -------------------------------------------------------------

@pytest.mark.slow
def test_sharded_prefill_and_every_strategy_on_4_ranks(small_model):
    """4 ranks, every strategy, a 301-token prompt (300 prefill tokens in 8 chunks of 37 or 38):
    every row equals transformers alone, each rank's pool holds its share only, and the prefill's
    ring moved what the plan says."""
    prompt = _prompt(301, 4096)
    expected = transformers_greedy(small_model, list(prompt), 24)
    strategies = (("tree", ReductionPlan("tree", 2)), ("allreduce", ReductionPlan("allreduce")), ("ring", None))
    spec = GenerateSpec(SMALL, prompt, LaunchSetup(world_size=4, plans=strategies, timeout_s=90.0), new_tokens=24)
    result = run_generate(spec)
    assert [r.name for r in result.rows] == [REFERENCE, ONE_RANK, "tree k=2", "allreduce", "ring"]
    for row in result.rows:
        assert row.tokens == expected, row.name
        assert row.matches and row.ranks_agree, row.name
        # each row's best logits per token came back from its rank 0 (spawned ranks: by pickle)
        assert [t.ids[0] for t in row.top] == expected, row.name
        assert len(row.step_s) == 24 and all(t > 0 for t in row.step_s)
    assert result.all_match and result.checked_against == REFERENCE
    shards = spec.shards()
    assert result.shard_sizes == [75, 75, 75, 75]
    shape = ModelShape.from_config(small_model.config.to_dict())
    from tree_attn.reduce.ring_prefill import plan_ring

    for rep in result.ranks:
        assert rep.prefill.tokens == shards.size(rep.rank)
        held = rep.prefill.tokens + (24 + 1 if rep.rank == 3 else 0)
        pages = -(-held // spec.page_size)
        assert rep.kv_bytes == 2 * shape.layers * pages * spec.page_size * shape.kv_heads * shape.head_dim * 4
        sent, messages = plan_ring(shards, rep.rank).block_bytes_sent(shape.kv_heads, shape.head_dim, 4)
        assert rep.prefill.timing.stats.bytes_sent == shape.layers * sent
        assert rep.prefill.timing.stats.messages == shape.layers * messages
        assert rep.prefill.timing.pairs == shape.layers * shards.causal_pairs(rep.rank)
    # The capacity estimate against each rank's measured peak (RSS high-water, CPU): an upper bound,
    # and within 30% (at this size the process's fixed 500 MiB dominates; benchmarks/bench_prefill.py
    # checks the margin where KV and activations do).
    from tree_attn.commands.generate.memory import Budget, JobShape, estimate_generate
    from tree_attn.cost.capacity import ModelDims

    job = JobShape(ModelDims.from_config(small_model.config.to_dict()), 24, "float32", "float32", "cpu",
                   spec.page_size, preset=True, ring_decode=True)
    est = estimate_generate(job, len(prompt), 4, Budget("cpu"), 4, spawned=True)
    for rep in result.ranks:
        assert rep.peak_method in ("high-water mark", "sampled")
        assert 0.7 * est.ranks[rep.rank].total <= rep.peak_bytes <= est.ranks[rep.rank].total, rep.to_dict()
        assert rep.peak_bytes >= rep.prefill_peak_bytes > rep.start_bytes
    # bytes per token: a tree sends one merge state per layer at most per rank, (Hq, D + 1) float32
    state = shape.q_heads * (shape.head_dim + 1) * 4
    tree = next(r for r in result.rows if r.name.startswith("tree"))
    assert tree.messages_per_token % shape.layers == 0 and tree.bytes_per_token == tree.messages_per_token * state
    ring = next(r for r in result.rows if r.name == "ring")
    assert ring.bytes_per_token > 10 * tree.bytes_per_token  # ring moves KV pages: far more than the states


@pytest.mark.slow
@pytest.mark.parametrize("model_type, world, prompt_len, extra", [
    ("qwen2", 3, 153, {}),  # 152 prefill tokens: not a multiple of 3 or of 6 chunks
    ("mistral", 5, 148, {"sliding_window": None}),  # 147 over 5 ranks, 10 chunks
])
def test_qwen2_and_mistral_checkpoints_on_3_and_5_ranks(model_type, world, prompt_len, extra, tmp_path):
    folder = write_checkpoint(tmp_path / model_type, model_type, seed=7, **extra)
    source = ModelSource(path=str(folder))
    prompt = _prompt(prompt_len, 160, seed=2)
    expected = _reference(source, prompt, 16)
    launch = LaunchSetup(world_size=world, plans=TREE_AND_RING, timeout_s=90.0)
    # the one-process rows are covered elsewhere: only the sharded job is spawned here
    spec = GenerateSpec(source, prompt, launch, new_tokens=16, page_size=5, reference=OFF, one_rank=OFF)
    result = run_generate(spec)
    assert [r.tokens for r in _strategy_rows(result)] == [expected] * 2
    assert result.checked_against == "each other" and result.all_match
    assert sum(result.shard_sizes) == prompt_len - 1 and len(set(result.shard_sizes)) == 2


@pytest.mark.slow
def test_a_prompt_shorter_than_the_world_leaves_ranks_empty(small_model):
    """A 3-token prompt over 5 ranks: 2 prefill tokens, so ranks 2, 3 and 4 hold none (they still
    relay every layer's blocks) and only the last grows by the new tokens."""
    prompt = _prompt(3, 4096, seed=9)
    launch = LaunchSetup(world_size=5, plans=TREE_AND_RING, timeout_s=90.0)
    spec = GenerateSpec(SMALL, prompt, launch, new_tokens=12, reference=OFF, one_rank=OFF)
    assert spec.shard_sizes() == [1, 1, 0, 0, 0]
    result = run_generate(spec)
    expected = transformers_greedy(small_model, list(prompt), 12)
    assert [r.tokens for r in _strategy_rows(result)] == [expected] * 2


@pytest.mark.slow
def test_negative_control_one_broken_rank_changes_the_tokens(small_model):
    """Rank 1 of 2 flips its keys in every layer of its prefill (each key at another's position),
    in its pool and in the blocks it sends: the tokens differ from transformers'. Unbroken, the
    same prompt and model give them (the one-rank and 4-rank tests; 2 ranks: the torchrun ones)."""
    from tree_attn.launch.job import run_ranks

    prompt = _prompt(301, 4096)
    expected = transformers_greedy(small_model, list(prompt), 16)
    launch = LaunchSetup(world_size=2, plans=TREE, timeout_s=90.0)
    spec = GenerateSpec(SMALL, prompt, launch, new_tokens=16)
    broken = run_ranks(rank_with_flipped_keys, launch, args=(spec, TREE, 1)).values
    assert all(rep.runs["tree k=2"].tokens != expected for rep in broken)


# -- the CLI's verdict ------------------------------------------------------------------------------

def _fake_result(rows, against):
    from tree_attn.commands.generate import decode as gen

    return gen.GenerateResult("m", True, 10, 3, 2, "cpu", "gloo", "float32", 16, 0.1, rows, shard_sizes=[5, 4],
                              checked_against=against)


def test_cli_exits_1_when_a_row_differs(monkeypatch, capsys):
    """The check behind exit 1: a result whose tree row lost a token is reported, not passed."""
    from tree_attn.cli.app import main
    from tree_attn.commands.generate import decode as gen

    rows = [GenerateRow(REFERENCE, 1, [1, 2, 3], [0.01] * 3), GenerateRow(ONE_RANK, 1, [1, 2, 3], [0.01] * 3),
            GenerateRow("tree k=2", 2, [1, 2, 4], [0.01] * 3, matches=False)]
    monkeypatch.setattr(gen, "run_generate", lambda spec, progress=None, tokenizer=None: _fake_result(rows, REFERENCE))
    code = main(["generate", "--device", "cpu", "-w", "2", "--layers", "1", "--prompt-len", "10", "--new-tokens", "3"])
    err = capsys.readouterr().err
    assert code == 1
    assert "tree k=2: generated tokens differ from the reference's" in err


def test_cli_reports_a_near_tie_as_such_and_a_difference_with_its_distance(monkeypatch, capsys):
    """A bf16 row that parts from the reference at a near-tie of the reference's logits passes, shown
    as "tie at N" with the gap; one beyond the tie's ulps exits 1 saying where and how far."""
    from tree_attn.cli.app import main
    from tree_attn.commands.generate import decode as gen
    from tree_attn.commands.generate.ties import StepTop

    top = [StepTop((1, 5), (30.0, 20.0)), StepTop((2, 6), (25.0, 20.0)), StepTop((3, 4, 7), (21.5, 20.75, 19.0))]

    def result(tree_tokens):
        rows = [GenerateRow(REFERENCE, 1, [1, 2, 3], [0.01] * 3, top=top),
                GenerateRow(ONE_RANK, 1, [1, 2, 3], [0.01] * 3),
                GenerateRow("tree k=2", 2, tree_tokens, [0.01] * 3)]
        res = _fake_result(rows, gen._check(rows, torch.bfloat16))
        res.dtype = "bfloat16"
        return res

    args = ["generate", "--device", "cpu", "-w", "2", "--layers", "1", "--prompt-len", "10", "--new-tokens", "3"]
    monkeypatch.setattr(gen, "run_generate", lambda spec, progress=None, tokenizer=None: result([1, 2, 4]))
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "tie at 3" in out and "at token 3 it took 4, the reference 3" in out and "6.0 ulps of bfloat16" in out
    assert "parted from them only at a near-tie" in out
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    tree = data["rows"][2]
    assert data["all_match"] is True and tree["matches"] is False and tree["near_tie"]["ulps"] == 6.0
    monkeypatch.setattr(gen, "run_generate", lambda spec, progress=None, tokenizer=None: result([1, 2, 7]))
    assert main(args) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "tree k=2: parts from the reference at token 3: 7 against the reference's 3" in err and "20.0 ulps" in err


def test_cli_says_what_the_rows_were_checked_against(monkeypatch, capsys):
    """Without the reference (skipped: it did not fit), the table shows why, the rows are checked
    against each other, and a disagreement still exits 1."""
    from tree_attn.cli.app import main
    from tree_attn.commands.generate import decode as gen

    skipped = "skipped: needs 40.0 GiB in one process, 20.0 GiB available"
    rows = [GenerateRow(REFERENCE, 1, [], [], skipped=skipped), GenerateRow(ONE_RANK, 1, [], [], skipped=skipped),
            GenerateRow("tree k=2", 2, [1, 2, 3], [0.01] * 3), GenerateRow("ring", 2, [1, 2, 3], [0.01] * 3)]
    monkeypatch.setattr(gen, "run_generate",
                        lambda spec, progress=None, tokenizer=None: _fake_result(rows, "each other"))
    args = ["generate", "--device", "cpu", "-w", "2", "--layers", "1", "--prompt-len", "10", "--new-tokens", "3"]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert skipped in out and "rows checked against each other" in out
    rows[3] = GenerateRow("ring", 2, [1, 2, 4], [0.01] * 3, matches=False)
    assert main(args) == 1
    assert "ring: generated tokens differ from each other's" in " ".join(capsys.readouterr().err.split())
    assert main([*args, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["checked_against"] == "each other" and data["rows"][0] == {"name": REFERENCE, "ranks": 1,
                                                                           "skipped": skipped}


# -- where the work runs, transformers' cache API, the dtype default --------------------------------

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
    assert any("bfloat16: rounding differs" in n and "within 8 x sqrt(layers) ulps" in n for n in on_gpu.own_notices)
    assert not any("rounding" in w for w in on_gpu.warnings)
    assert plan_generate(GenerateOptions(device="cpu", world_size=2, **small)).spec.dtype == "float32"
    assert plan_generate(GenerateOptions(dtype="fp32", **small)).spec.dtype == "float32"  # asked for: kept
    assert plan_generate(GenerateOptions(device="cpu", world_size=2, dtype="fp16", **small)).spec.dtype == "float16"


def test_a_hub_id_names_its_snapshot_in_the_local_cache(tmp_path, monkeypatch, capsys):
    """``--model org/name`` (and ``fit --config org/name``): the snapshot of ``main`` already in
    the local Hugging Face cache, found without the network; the model is labelled by the id; a
    folder of that relative name wins; an id not in the cache is refused in one line that says
    nothing is downloaded."""
    import huggingface_hub.constants as hub_constants

    from tree_attn.cli.app import main
    from tree_attn.commands.generate.setup import GenerateOptions, plan_generate

    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny-org--tiny-llama" / "snapshots" / ("ab" * 20)
    write_checkpoint(snapshot, "llama", tokenizer=True)
    (cache / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("ab" * 20)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # and no network: a look-up would fail, not wait
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    setup = plan_generate(GenerateOptions(model="tiny-org/tiny-llama", device="cpu", world_size=2, prompt="the tree",
                                          new_tokens=2))
    assert Path(setup.spec.source.path) == snapshot.resolve() and setup.spec.source.label == "tiny-org/tiny-llama"
    assert main(["fit", "--config", "tiny-org/tiny-llama", "--device", "cpu", "--memory", "4GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["largest_prompt"] > 0
    local = tmp_path / "tiny-org" / "tiny-llama"  # a folder of the same relative name is what it names
    write_checkpoint(local, "llama")
    setup = plan_generate(GenerateOptions(model="tiny-org/tiny-llama", device="cpu", world_size=2, new_tokens=2,
                                          prompt_len=8))
    assert setup.spec.source.path == "tiny-org/tiny-llama" and setup.spec.source.label == "tiny-llama"
    capsys.readouterr()  # the checkpoints' writing
    assert main(["generate", "--device", "cpu", "--model", "other-org/absent"]) == 1
    line = capsys.readouterr().err.strip()
    assert "no such folder" in line and "hub id in this machine's Hugging Face cache" in line
    assert "hf download other-org/absent" in line and len(line.splitlines()) == 1
    assert main(["fit", "--config", "other-org/absent", "--device", "cpu", "--memory", "4GiB"]) == 1
    assert "hf download other-org/absent" in capsys.readouterr().err


def test_generate_help_states_the_dtype_default():
    from typer.testing import CliRunner

    from tree_attn.cli.app import app

    out = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "300", "TERM": "dumb"}).output
    assert "auto (bf16 on GPUs, float32 on CPU ranks)" in " ".join(out.split())
    assert "--cuda-graph" in out and "--no-cuda-graph" in out


def test_no_cuda_graph_reaches_the_spec():
    from tree_attn.commands.generate.setup import GenerateOptions, plan_generate

    small = dict(preset="small", layers=1, prompt_len=40, new_tokens=2)
    assert plan_generate(GenerateOptions(device="cpu", world_size=2, **small)).spec.cuda_graph is True
    off = plan_generate(GenerateOptions(device="cpu", world_size=2, cuda_graph=False, **small))
    assert off.spec.cuda_graph is False


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
def test_generate_on_gpus_leaves_the_launching_process_without_cuda(tmp_path):
    """On a GPU: the launching process of ``generate`` (and of ``tune``'s kernel search, and of
    ``run --kv-dtype fp8``) never initialises CUDA, so it holds no context on GPU 0 beside rank 0's."""
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
    # run's fp8 launch check asks NVML, not torch, for each rank's compute capability
    script = (
        "import torch\n"
        "from tree_attn.cli.app import main\n"
        "code = main(['run', '-w', '1', '-n', '4096', '--kv-dtype', 'fp8', '--steps', '2', '--warmup', '1', "
        "'--strategy', 'tree', '--json'])\n"
        "assert code == 0, code\n"
        "assert not torch.cuda.is_initialized(), 'run --kv-dtype fp8 initialised CUDA in the launching process'\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=400, env=env,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["config"]["kv_dtype"] == "float8_e4m3fn"


# -- the paged shard ------------------------------------------------------------------------------

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


# -- a Llama checkpoint with a tokenizer through the CLI --------------------------------------------

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
    assert result["all_match"] is True and result["checked_against"] == "reference"
    assert [r["name"] for r in result["rows"]] == [REFERENCE, ONE_RANK, "tree k=2", "ring"]
    for row in result["rows"]:
        assert row["tokens"] == expected, row["name"]
        assert row["text"] == tok.decode(expected)
    # no process held the whole cache: each rank's pool is its share (+ the new tokens on the last)
    n = len(ids) - 1
    assert [r["prefill"]["tokens"] for r in result["ranks"]] == result["prefill_tokens_per_rank"]
    assert sum(result["prefill_tokens_per_rank"]) == n and max(result["prefill_tokens_per_rank"]) <= n // 2 + 1
    assert result["launcher_peak_bytes"] < result["ranks"][0]["peak_bytes"]
    assert result["cuda_graph"] is True  # asked for; CPU ranks have nothing to capture, and say so
    assert [(r["execution"], r["why_eager"]) for r in result["rows"][1:]] == (
        [("eager", "cpu tensors: nothing to capture")] * (len(result["rows"]) - 1))
    assert result["profile"]["chosen_by"] in ("default", "builtin", "saved")
    assert "[rank 0]" in proc.stderr and "prefill" in proc.stderr and "FutureWarning" not in proc.stderr
    # the one-rank row's prefill reads as one rank's (was "over 1 rank (zig-zag, 143-143 each)")
    assert f"prefill: {n:,} tokens on one rank" in proc.stderr and "over 1 rank" not in proc.stderr
    # no progress bar of transformers' per process, and none of the multiprocessing lock it leaves
    # behind (Python's "leaked semaphore objects" warning at exit)
    assert "Loading weights" not in proc.stderr and "leaked semaphore" not in proc.stderr, proc.stderr[-2000:]


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
    assert result.checked_against == REFERENCE
    for row in result.rows[1:]:  # each token one CUDA graph replay, but the ring's (whole shards travel)
        assert row.execution == ("eager" if row.name == "ring" else "cuda graph"), (row.name, row.why_eager)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
def test_generate_in_bf16_on_gpus_gives_the_reference_or_parts_at_a_near_tie():
    """generate's default on GPUs (bf16, the 4-layer small preset): every row's tokens equal the
    reference's or part from them at a near-tie the rule accepts (ties.py: on one H100 an 8K
    prompt parted at a 6-ulp tie of transformers' own logits), each row's logits recorded per token
    from its graph's static output (ranks that disagree never pass)."""
    source = ModelSource(preset="small")
    prompt = _prompt(4096, 4096, seed=2)
    launch = LaunchSetup(world_size=min(2, torch.cuda.device_count()), device_kind="cuda", backend="nccl",
                         dtype="bfloat16", plans=TREE_AND_RING, timeout_s=120.0)
    result = run_generate(GenerateSpec(source, prompt, launch, new_tokens=16))
    assert result.checked_against == REFERENCE and result.layers == 4
    for row in result.rows:
        assert len(row.tokens) == 16 and row.ranks_agree, row.name
        # the token is the recorded best (by value: bf16 logits can tie exactly, and topk may order
        # equal values otherwise than argmax picks)
        assert all(t.logit_of(tok) == t.logits[0] for t, tok in zip(row.top, row.tokens, strict=True)), row.name
        assert row.ok, (row.name, row.tokens, result.rows[0].tokens, row.near_tie)
    assert result.all_match


# -- under torchrun: one node, and two "nodes" on loopback ------------------------------------------

GEN_ARGS = ["generate", "--device", "cpu", "--layers", "2", "--seed", "3", "--prompt-len", "201", "--new-tokens", "16",
            "--timeout", "90", "--json"]


def _expected_for_cli_prompt() -> list[int]:
    """What the CLI's arguments above decode, from transformers alone."""
    from tree_attn.commands.generate.setup import parse_prompt

    model = build_model(SMALL, dtype=torch.float32, device="cpu")
    ids, _ = parse_prompt(None, 201, 4096, 3, None)
    return transformers_greedy(model, ids, 16)


@pytest.mark.slow
def test_generate_under_torchrun_on_3_ranks(tmp_path):
    """torchrun with 3 ranks on one node: every rank prefills its zig-zag share (200 tokens: 67,
    67 and 66), rank 0 reports, then runs the one-process rows (the one-rank row spawned as a job
    of one rank, the reference in a child)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "-m", "tree_attn", *GEN_ARGS]
    env = clean_env(TREE_ATTN_PROFILE_DIR=str(tmp_path / "profiles"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # only rank 0 prints
    assert proc.stderr.count("generating 16 tokens") == 1
    assert result["world_size"] == 3 and result["all_match"] is True and result["checked_against"] == REFERENCE
    assert result["prefill_tokens_per_rank"] == [67, 67, 66]
    expected = _expected_for_cli_prompt()
    assert [r["name"] for r in result["rows"]] == [REFERENCE, ONE_RANK, "tree k=2", "ring"]
    assert all(r["tokens"] == expected for r in result["rows"])


@pytest.mark.slow
def test_generate_across_two_nodes_on_loopback(tmp_path):
    """2 torchrun "nodes" x 1 CPU rank (c10d rendezvous, gloo on loopback): the prefill's ring and
    the tree's one edge cross the network level; every row gives transformers' tokens."""
    env = clean_env(TREE_ATTN_PROFILE_DIR=str(tmp_path / "profiles"), GLOO_SOCKET_IFNAME="lo")
    outs = run_nodes(GEN_ARGS, nodes=2, per_node=1, env=env, cwd=tmp_path, timeout=240,
                     rdzv_id="tree-attn-generate-test")
    for code, _, err in outs:
        assert code == 0, err[-3000:]
    reports = [out for _, out, _ in outs if out.strip()]
    assert len(reports) == 1, outs  # the node that holds rank 0 reports
    result = json.loads(reports[0])
    assert result["world_size"] == 2 and result["all_match"] is True
    assert "2 nodes x 1 ranks (torchrun)" in result["profile"]["text"]
    assert [r["name"] for r in result["rows"]] == [REFERENCE, ONE_RANK, "hier net k=2", "ring"]
    expected = _expected_for_cli_prompt()
    assert all(r["tokens"] == expected for r in result["rows"])
    assert all(r["prefill"]["bytes_sent"] > 0 for r in result["ranks"])  # the ring crossed the nodes


# -- --kv-dtype fp8 ---------------------------------------------------------------------------------

def test_generate_help_states_the_kv_dtype():
    from typer.testing import CliRunner

    from tree_attn.cli.app import app

    out = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "300", "TERM": "dumb"}).output
    out = " ".join(out.split())
    assert "--kv-dtype" in out and "take together from the whole prompt" in out and "token for token" in out


def test_kv_dtype_fp8_reaches_the_spec_and_the_capacity_counts_1_byte():
    """--kv-dtype fp8: the spec's KV dtype is float8_e4m3fn (the dtype stays float32), every
    strategy runs (ring too: it sends each rank's scales with its pool), and the capacity
    estimate's KV is exactly a quarter of float32's."""
    from tree_attn.commands.generate.setup import GenerateOptions, plan_generate

    common = {"device": "cpu", "world_size": 2, "layers": 1, "prompt_len": 200, "new_tokens": 3,
              "strategy": "tree,allreduce,ring"}
    fp8 = plan_generate(GenerateOptions(kv_dtype="fp8", **common))
    f32 = plan_generate(GenerateOptions(**common))
    assert fp8.spec.kv_dtype == "float8_e4m3fn" and fp8.spec.dtype == f32.spec.dtype == f32.spec.kv_dtype == "float32"
    assert [n for n, _ in fp8.spec.plans] == [n for n, _ in f32.spec.plans] == ["tree", "allreduce", "ring"]
    assert not any("ring" in n for n in fp8.own_notices)
    assert any("scales from the whole prompt" in n and "quantized the same way" in n for n in fp8.own_notices)
    for a, b in zip(fp8.spec.estimate.ranks, f32.spec.estimate.ranks, strict=True):
        assert a.kv > 0 and 4 * a.kv == b.kv and a.weights == b.weights


def test_fp8_rows_are_checked_token_for_token():
    """A quantized row is checked as any row (the reference reads its cache quantized alike): tokens
    that differ fail it, and the positions that agree are counted."""
    rows = [GenerateRow(REFERENCE, 1, [1, 2, 3, 4], [0.01] * 4),
            GenerateRow("tree k=2", 2, [1, 2, 5, 4], [0.01] * 4, quantized=True),
            GenerateRow("one rank", 1, [1, 2, 3, 4], [0.01] * 4, quantized=True)]
    assert _check(rows) == REFERENCE
    assert rows[1].same_tokens == 3 and not rows[1].matches and not rows[1].ok
    assert rows[1].to_dict()["same_tokens"] == 3 and rows[1].to_dict()["quantized"] is True
    assert rows[2].matches and rows[2].ok
    rows[2].ranks_agree = False
    assert not rows[2].ok


@pytest.mark.slow
def test_fp8_kv_on_2_ranks_tree_and_ring(small_model):
    """2 CPU ranks, tree and ring, fp8 KV (float32 model: the ranks' kernels and the reference
    differ by rounding only): the tokens of both equal those of the reference, transformers with
    its cache read through fp8 with the whole prompt's scales, and of the one-rank row, whose
    scales come from the whole prompt in one process; each rank's pools are fp8 (1 byte per
    element, plus one float32 scale per layer, KV head, K and V); the ring sends per layer its
    lengths, its whole pool and its scales (8 * Hkv bytes)."""
    prompt = _prompt(161, 4096, seed=4)
    launch = LaunchSetup(world_size=2, plans=TREE_AND_RING, timeout_s=90.0, kv_dtype="fp8")
    spec = GenerateSpec(SMALL, prompt, launch, new_tokens=8)
    assert spec.kv_dtype == "float8_e4m3fn" and spec.dtype == "float32"
    result = run_generate(spec)
    ref, one, (tree, ring) = result.rows[0], result.rows[1], _strategy_rows(result)
    assert ref.name == REFERENCE and one.name == "one rank" and ring.name == "ring"
    assert tree.quantized and ring.quantized and one.quantized and tree.ranks_agree and ring.ranks_agree
    assert ring.tokens == tree.tokens == one.tokens == ref.tokens and len(ref.tokens) == 8, result.rows
    assert result.all_match and result.checked_against == REFERENCE and result.to_dict()["kv_dtype"] == "float8_e4m3fn"
    shape = ModelShape.from_config(small_model.config.to_dict())
    sent = []
    for rep in result.ranks:
        held = rep.prefill.tokens + (8 + 1 if rep.rank == 1 else 0)
        pages = -(-held // spec.page_size)
        pool = 2 * shape.layers * pages * spec.page_size * shape.kv_heads * shape.head_dim
        assert rep.kv_bytes == pool * 1 + 2 * shape.layers * shape.kv_heads * 4  # bf16: pool * 2
        sent.append(shape.layers * (4 + pool // shape.layers + 8 * shape.kv_heads))
    assert ring.bytes_per_token == max(sent) and ring.messages_per_token == shape.layers * 4


@pytest.mark.slow
def test_fp8_kv_on_3_ranks_with_an_empty_last_rank_tree_and_ring(small_model):
    """A 3-token prompt over 3 ranks, fp8 KV: the last rank's prefill has no token; it takes the
    scales the ranks agree on (the whole prompt's) and quantizes every new token with them, as
    the reference quantizes its cache. Tree and ring give the reference's tokens, token for token,
    and every rank's pool holds its scales."""
    prompt = _prompt(3, 4096, seed=9)
    launch = LaunchSetup(world_size=3, plans=TREE_AND_RING, timeout_s=90.0, kv_dtype="fp8")
    spec = GenerateSpec(SMALL, prompt, launch, new_tokens=6, one_rank=OFF)
    assert spec.shard_sizes() == [1, 1, 0]
    result = run_generate(spec)
    ref, (tree, ring) = result.rows[0], _strategy_rows(result)
    assert ref.name == REFERENCE and result.checked_against == REFERENCE
    assert ring.tokens == tree.tokens == ref.tokens and len(ref.tokens) == 6, result.rows
    assert tree.ranks_agree and ring.ranks_agree and result.all_match
    shape = ModelShape.from_config(small_model.config.to_dict())
    pool = 2 * shape.layers * spec.page_size * shape.kv_heads * shape.head_dim  # one page a rank
    assert [rep.kv_bytes for rep in result.ranks] == [pool + 2 * shape.layers * shape.kv_heads * 4] * 3
