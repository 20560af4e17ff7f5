"""generate's decode path: each layer's attention prepared once per session, the token step (one
CUDA graph on GPUs, the same code eagerly on CPU), the device-side KV slot and ``seq_lens``.

CPU ranks and CPU tensors (gloo) except the tests marked ``gpu``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tests.generate.checkpoints import transformers_greedy
from tests.generate.counting import counting_calls
from tree_attn.commands.generate.decode import GenerateSpec, ModelShape, decode_tokens
from tree_attn.commands.generate.hf_attention import CONTEXT_KWARG, DecodeContext, use_tree_attention
from tree_attn.commands.generate.kv_store import PagedKVShard
from tree_attn.commands.generate.models import ModelSource, build_model
from tree_attn.commands.generate.prefill import ShardedPrefill, sharded_prefill
from tree_attn.commands.generate.ties import step_top
from tree_attn.commands.generate.token_step import GRAPHS_OFF, TokenStep, graph_blocker
from tree_attn.launch.setup import LaunchSetup
from tree_attn.launch.spawn import launch_ranks
from tree_attn.reduce.plan import ReductionPlan
from tree_attn.reduce.ring_prefill import plan_ring
from tree_attn.reduce.zigzag import zigzag

SOURCE = ModelSource(preset="small", layers=3, seed=5)
PROMPT_LEN, NEW = 150, 10
HAS_GPU = torch.cuda.is_available()


def _prompt(n: int, seed: int = 2) -> list[int]:
    return torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model():
    m = build_model(SOURCE, dtype=torch.float32, device="cpu")
    return m


@pytest.fixture(scope="module")
def expected(model):
    tokens = transformers_greedy(model, _prompt(PROMPT_LEN), NEW + 4)
    assert len(set(tokens)) > 4, "a repeated token would prove little"
    return tokens


def _local_context(model, prompt: list[int], extra: int, *, device="cpu", page_size: int = 16, seed: int = 0):
    """A one-process decode context holding the prefill of ``prompt[:-1]`` and room for ``extra``:
    generate's sharded prefill at world size 1 (the one-rank row's), straight into the pool."""
    use_tree_attention(model)
    n = len(prompt) - 1
    shape = ModelShape.from_config(model.config.to_dict())
    store = PagedKVShard.allocate(shape.layers, n + extra, shape.kv_heads, shape.head_dim,
                                  dtype=torch.float32, device=device, page_size=page_size, seed=seed)
    sharded_prefill(model, prompt, ShardedPrefill(store, plan_ring(zigzag(n, 1), 0)))
    assert store.length == n
    return DecodeContext(store, "local", holds_new=True), n


# -- built once per layer per session, nothing per token --------------------------------------------

def test_one_rank_builds_each_layer_step_once_and_nothing_per_token(model, expected):
    ctx, start = _local_context(model, _prompt(PROMPT_LEN), NEW + 1)
    layers = ModelShape.from_config(model.config.to_dict()).layers
    with counting_calls() as (counts, built):
        run = decode_tokens(model, ctx, _prompt(PROMPT_LEN)[-1], start, NEW, lambda t: None, "local")
        after = dict(counts)
    assert run.tokens == expected[:NEW]
    assert len(built) == 1
    assert built[0]["DecodeStep.__init__"] == layers and built[0]["PreparedDecode.__init__"] == layers
    assert built[0]["prepared.prepared_decode"] == 0 and built[0]["dispatch.prepared_decode"] == 0
    assert after == dict(built[0]), "a token built or looked something up"
    assert run.execution == "eager" and run.why_eager == "cpu tensors: nothing to capture"


@pytest.mark.parametrize("world, plans", [
    (2, (("tree", ReductionPlan("tree", 2)), ("ring", None))),
    (3, (("tree", ReductionPlan("tree", 3)), ("allreduce", ReductionPlan("allreduce")), ("ring", None))),
])
def test_ranks_build_each_layer_step_once_and_nothing_per_token(world, plans, expected):
    from tests.generate.rank_fns import counted_generate_rank

    layers = SOURCE.layers
    spec = GenerateSpec(SOURCE, tuple(_prompt(PROMPT_LEN)), LaunchSetup(world_size=world, plans=plans, timeout_s=60.0),
                        new_tokens=NEW)
    per_rank = launch_ranks(counted_generate_rank, world, args=(spec,), timeout_s=120)
    for rank, runs in enumerate(per_rank):
        assert set(runs) == {plan.label if plan is not None else "ring" for _, plan in plans}
        for label, (tokens, built, after) in runs.items():
            where = f"rank {rank}, {label}"
            assert tokens == expected[:NEW], where
            assert after == built, f"{where}: a token built or looked something up: {built} -> {after}"
            assert built.get("collectives._cached_merge", 0) == 0, where
            assert built.get("collectives.tree_decode", 0) == 0 and built.get("ring.ring_decode", 0) == 0, where
            assert all(built.get(f"{m}.prepared_decode", 0) == 0 for m in ("prepared", "dispatch", "ring")), where
            if label == "ring":
                assert built["RingDecodeStep.__init__"] == layers, where
                # one kernel for its own shard and one per other rank's block, per layer
                assert built["PreparedDecode.__init__"] == layers * world, where
            else:
                assert built["TreeDecodeStep.__init__"] == layers, where
                assert built["collectives._new_merge"] == layers, where
                assert built["PreparedDecode.__init__"] == layers, where


# -- the token step's device-side state -------------------------------------------------------------

def test_paged_slots_are_computed_on_the_device_as_the_table_says():
    store = PagedKVShard.allocate(1, 70, 2, 8, dtype=torch.float32, device="cpu", page_size=16, seed=4)
    positions = torch.tensor([0, 15, 16, 17, 31, 32, 47, 63, 69])
    blocks, offsets = store.slots(positions)
    table = store.block_table[0].tolist()
    assert blocks.tolist() == [table[p // 16] for p in positions.tolist()]
    assert offsets.tolist() == [p % 16 for p in positions.tolist()]
    assert blocks.dtype == torch.int64 and blocks.device == positions.device


def _valid_kv(store: PagedKVShard, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks, offsets = store.slots(torch.arange(store.length))
    return store.k[layer][blocks, offsets], store.v[layer][blocks, offsets]


@pytest.mark.parametrize("page_size", [16, 5])
def test_token_step_writes_kv_and_advances_seq_lens_as_host_counted_forwards_do(model, expected, page_size):
    """The token step (slot and seq_lens from a device-tensor position, as in its graph) against
    eager forwards that place each token from the host's count: same tokens, same KV in every
    slot, and the device state ends one past the last token. ``cuda_graph=False`` runs the same."""
    prompt = _prompt(PROMPT_LEN)
    layers = ModelShape.from_config(model.config.to_dict()).layers
    ctx, start = _local_context(model, prompt, NEW, page_size=page_size, seed=1)
    step = TokenStep(model, ctx, prompt[-1], start)
    tokens, tops = [], []
    try:
        with pytest.raises(RuntimeError, match="no token has been decoded yet"):
            step.top()
        for _ in range(NEW):
            tokens.append(step())
            tops.append(step.top())  # the token's best logits, read after it (ties.py)
    finally:
        step.close()
        ctx.close()
    assert tokens == expected[:NEW] and [t.ids[0] for t in tops] == tokens
    assert ctx.store.length == start + NEW
    assert int(ctx.position) == start + NEW and ctx.store.seq_lens.tolist() == [start + NEW]

    host, _ = _local_context(model, prompt, NEW, page_size=page_size, seed=1)
    fed = [prompt[-1]] + tokens[:-1]
    with torch.inference_mode():
        for i, token in enumerate(fed):
            host.begin(1)
            logits = model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[start + i]]), use_cache=False,
                           logits_to_keep=1, **{CONTEXT_KWARG: host}).logits
            host.end()
            assert int(logits[0, -1].argmax()) == tokens[i]
            assert step_top(logits[0, -1]).ids == tops[i].ids
            assert torch.allclose(torch.tensor(step_top(logits[0, -1]).logits), torch.tensor(tops[i].logits))
    host.close()
    assert host.store.length == ctx.store.length
    for layer in range(layers):
        for mine, theirs in zip(_valid_kv(ctx.store, layer), _valid_kv(host.store, layer)):
            assert torch.equal(mine, theirs), layer

    off, start = _local_context(model, prompt, NEW, page_size=page_size, seed=1)
    run = decode_tokens(model, off, prompt[-1], start, NEW, lambda t: None, "local", cuda_graph=False)
    assert run.tokens == tokens


def test_a_verify_forward_of_several_tokens_takes_the_greedy_tokens(model, expected):
    """Sq > 1 (causal) through the prepared steps: feed the last prompt token and three greedy
    tokens in one forward; each position's argmax is the next greedy token; then single-token
    decoding goes on from there."""
    prompt = _prompt(PROMPT_LEN)
    ctx, start = _local_context(model, prompt, 8)
    fed = [prompt[-1]] + expected[:3]
    with torch.inference_mode():
        ctx.begin(len(fed))
        logits = model(input_ids=torch.tensor([fed]), position_ids=torch.arange(start, start + 4).view(1, 4),
                       use_cache=False, **{CONTEXT_KWARG: ctx}).logits
        ctx.end()
    assert logits[0].argmax(-1).tolist() == expected[:4]
    assert ctx.store.length == start + 4
    run = decode_tokens(model, ctx, expected[3], start + 4, 3, lambda t: None, "local")
    assert run.tokens == expected[4:7]


def test_a_forward_of_too_many_tokens_is_refused(model):
    from tree_attn.commands.generate.hf_attention import MAX_NEW_PER_FORWARD
    from tree_attn.errors import ConfigError

    ctx, _ = _local_context(model, _prompt(20), 40)
    with pytest.raises(ConfigError, match=f"1..{MAX_NEW_PER_FORWARD} tokens"):
        ctx.begin(MAX_NEW_PER_FORWARD + 1)


def test_a_dynamic_rope_is_named_as_what_keeps_the_token_eager():
    from transformers import LlamaConfig, LlamaForCausalLM

    def tiny(**rope):
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, **rope)
        return LlamaForCausalLM(config)

    assert graph_blocker(tiny()) is None
    why = graph_blocker(tiny(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}))
    assert why is not None and "'dynamic'" in why and "host sync" in why


# -- GPUs: the token step as one CUDA graph --------------------------------------------------------

def _gpu_context(model, prompt):
    return _local_context(model, prompt, NEW + 1, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
def test_gpu_token_step_is_one_graph_replay_with_the_greedy_tokens():
    model = build_model(SOURCE, dtype=torch.float32, device="cuda")
    prompt = _prompt(PROMPT_LEN)
    want = transformers_greedy(model, prompt, NEW)
    ctx, start = _gpu_context(model, prompt)
    run = decode_tokens(model, ctx, prompt[-1], start, NEW, lambda t: None, "local", timeout_s=60.0,
                        record_top=True)
    assert run.execution == "cuda graph" and run.why_eager is None
    # float32 weights: the paged kernel and sdpa may round differently, so a near-tie could flip;
    # the eager run of the same code must agree exactly with the graph.
    ctx, start = _gpu_context(model, prompt)
    eager = decode_tokens(model, ctx, prompt[-1], start, NEW, lambda t: None, "local", cuda_graph=False,
                          record_top=True)
    assert eager.execution == "eager" and eager.why_eager == GRAPHS_OFF
    assert run.tokens == eager.tokens
    assert run.tokens == want
    # each replay's logits, read from the graph's static output after it: those of its own token
    assert [t.ids[0] for t in run.top] == run.tokens and len(run.top) == NEW
    assert [t.ids for t in run.top] == [t.ids for t in eager.top]
    assert all(abs(a - b) < 1e-4 for g, e in zip(run.top, eager.top, strict=True)
               for a, b in zip(g.logits, e.logits, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
def test_gpu_token_step_falls_back_to_eager_naming_why():
    """A forward with a host sync (a hook that reads a value) cannot be captured: the step runs
    eagerly with the reason, and the tokens are the same."""
    model = build_model(SOURCE, dtype=torch.float32, device="cuda")
    prompt = _prompt(PROMPT_LEN)
    ctx, start = _gpu_context(model, prompt)
    plain = decode_tokens(model, ctx, prompt[-1], start, NEW, lambda t: None, "local", cuda_graph=False)
    handle = model.model.layers[0].register_forward_hook(lambda mod, args, out: float(out[0].sum()) and None)
    try:
        ctx, start = _gpu_context(model, prompt)
        with pytest.warns(RuntimeWarning, match="CUDA graph capture failed"):
            run = decode_tokens(model, ctx, prompt[-1], start, NEW, lambda t: None, "local", timeout_s=60.0)
    finally:
        handle.remove()
    assert run.execution == "eager" and run.why_eager.startswith("capture failed")
    assert run.tokens == plain.tokens


# -- an fp8 pool: the layer's step reads it with the layer's scales ---------------------------------

def test_fp8_pool_layer_step_equals_float64_on_the_dequantized_pool(model):
    """The prefill writes layer l's K/V quantized (scales from that write); a new token is written
    with those scales; layer l's step then equals float64 attention over the dequantized pool
    (per layer: each layer's own scales, which differ, so a step given another layer's, or none,
    would not)."""
    from tree_attn.commands.generate.layer_steps import build_layer_step
    from tree_attn.kernels.fp8 import dequantize

    use_tree_attention(model)
    prompt = _prompt(70, seed=6)
    n = len(prompt) - 1
    shape = ModelShape.from_config(model.config.to_dict())
    store = PagedKVShard.allocate(shape.layers, n + 2, shape.kv_heads, shape.head_dim,
                                  dtype=torch.float8_e4m3fn, device="cpu", page_size=16, seed=1)
    sharded_prefill(model, prompt, ShardedPrefill(store, plan_ring(zigzag(n, 1), 0)))
    gen = torch.Generator().manual_seed(3)
    new_k, new_v = (4 * torch.randn(1, shape.kv_heads, shape.head_dim, generator=gen) for _ in range(2))
    for layer in range(shape.layers):
        store.write_slots(layer, *store.slots(torch.tensor([n])), new_k, new_v)
    store.set_length(n + 1)
    ctx = DecodeContext(store, "local", holds_new=True)
    assert not torch.equal(store.k_scale[0], store.k_scale[1])
    scale = shape.head_dim ** -0.5
    group = shape.q_heads // shape.kv_heads
    for layer in range(shape.layers):
        assert store.k[layer].dtype == torch.float8_e4m3fn and store.k_scale[layer].shape == (shape.kv_heads,)
        query = torch.randn(1, shape.q_heads, 1, shape.head_dim, generator=gen)
        out = build_layer_step(ctx, layer, query, scale)(query)  # [1, 1, Hq, D]
        k8, v8 = store.read(layer)  # [n + 1, Hkv, D] fp8
        k = dequantize(k8, store.k_scale[layer], torch.float64).repeat_interleave(group, 1)
        v = dequantize(v8, store.v_scale[layer], torch.float64).repeat_interleave(group, 1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", query[0, :, 0].double(), k) * scale, dim=-1)
        want = torch.einsum("hn,nhd->hd", weights, v)
        assert torch.allclose(out[0, 0].double(), want, atol=1e-5, rtol=1e-4), layer


def test_ranks_agree_on_fp8_scales_at_prefill_an_empty_rank_too():
    """3 CPU ranks (gloo), one with no prompt token: every rank fixes each layer's scales to the
    whole prompt's per-head maxima / 448 (one all-reduce MAX per layer), the ones one process
    would take, not its own shard's (and not 1 where it holds nothing)."""
    from tests.generate.rank_fns import scales_agreed_at_prefill

    per_rank = launch_ranks(scales_agreed_at_prefill, 3, args=((13, 0, 6),), timeout_s=60)
    _, (whole_k, whole_v) = per_rank[0]
    for rank, (layers, _) in enumerate(per_rank):
        for layer, (ks, vs) in enumerate(layers):
            assert torch.equal(ks, whole_k * (layer + 1)), (rank, layer)
            assert torch.equal(vs, whole_v), (rank, layer)


def test_the_fp8_reference_attends_over_its_cache_through_fp8():
    """The reference's attention under fp8 (written apart from the ranks' quantizer): prompt calls
    read the K/V as they are; a decode call reads K and V rounded through e4m3 with per-head scales
    from the prompt's positions (the new one excluded), saturating. Against float64."""
    from types import SimpleNamespace

    from tree_attn.commands.generate.reference import FP8CacheAttention

    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, n = 4, 2, 16, 37
    module = SimpleNamespace(layer_idx=0, is_causal=True, num_key_value_groups=hq // hkv, training=False)
    attend = FP8CacheAttention(torch.float8_e4m3fn)
    key = torch.randn(1, hkv, n, d, generator=gen) * torch.tensor([1.0, 6.0]).view(1, 2, 1, 1)
    value = torch.randn(1, hkv, n, d, generator=gen)
    key[0, 0, -1] = 50.0  # the new token, beyond the prompt's largest: saturates at 448 x scale
    query = torch.randn(1, hq, 1, d, generator=gen)

    def truth(k, v):
        k, v = k.double().repeat_interleave(hq // hkv, 1), v.double().repeat_interleave(hq // hkv, 1)
        w = torch.softmax(torch.einsum("bhqd,bhnd->bhqn", query.double(), k) * d ** -0.5, dim=-1)
        return torch.einsum("bhqn,bhnd->bqhd", w, v)  # transformers' layout [B, Sq, Hq, D]

    out, _ = attend(module, query, key, value, None, scaling=d ** -0.5)
    assert torch.allclose(out.double(), truth(key, value), atol=1e-5)  # not decoding yet: as stored
    attend.decoding = True
    out, _ = attend(module, query, key, value, None, scaling=d ** -0.5)
    ks = key[:, :, :-1].abs().amax(dim=(0, 2, 3)) / 448
    vs = value[:, :, :-1].abs().amax(dim=(0, 2, 3)) / 448
    k8 = (key / ks.view(1, -1, 1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn).double() * ks.view(1, -1, 1, 1)
    v8 = (value / vs.view(1, -1, 1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn).double() * vs.view(1, -1, 1, 1)
    assert float(k8[0, 0, -1, 0]) == pytest.approx(448 * float(ks[0]))
    assert torch.allclose(out.double(), truth(k8, v8), atol=1e-5)
    assert not torch.allclose(out.double(), truth(key, value), atol=1e-3)  # the rounding shows


def test_an_fp8_prefill_without_tokens_gives_scales_of_1_and_new_tokens_are_written_with_them(model):
    """A 1-token prompt: the prefill has no token anywhere, so every maximum is 0 and every layer's
    scales are 1. The new tokens are then written with those 1s, stored as e4m3 values
    themselves (a value past 448 saturates, never NaN), the scales stay the tensors the steps
    were built with, and each layer's step equals float64 attention over the dequantized pool,
    out and lse."""
    from tests.paged_inputs import float64_over_shards
    from tests.tolerances import assert_decode_close, tol_for
    from tree_attn.commands.generate.layer_steps import build_layer_step
    from tree_attn.kernels.fp8 import dequantize

    use_tree_attention(model)
    shape = ModelShape.from_config(model.config.to_dict())
    store = PagedKVShard.allocate(shape.layers, NEW + 3, shape.kv_heads, shape.head_dim, dtype=torch.float8_e4m3fn,
                                  device="cpu", page_size=16, seed=2)
    sharded_prefill(model, [17], ShardedPrefill(store, plan_ring(zigzag(0, 1), 0)))
    assert store.length == 0
    ones = torch.ones(shape.kv_heads)
    fixed = [(store.k_scale[layer], store.v_scale[layer]) for layer in range(shape.layers)]
    assert all(torch.equal(ks, ones) and torch.equal(vs, ones) for ks, vs in fixed)
    written: dict[int, list] = {}
    real_write = store.write_slots

    def recording(layer, blocks, offsets, k, v):  # the float K/V the decode writes, as it writes them
        written.setdefault(layer, []).append((k.clone(), v.clone()))
        real_write(layer, blocks, offsets, k, v)

    store.write_slots = recording
    ctx = DecodeContext(store, "local", holds_new=True)
    run = decode_tokens(model, ctx, 17, 0, NEW, lambda t: None, "local")
    store.write_slots = real_write
    assert len(run.tokens) == NEW and store.length == NEW
    gen = torch.Generator().manual_seed(8)
    for layer in range(shape.layers):
        assert store.k_scale[layer] is fixed[layer][0] and store.v_scale[layer] is fixed[layer][1]
        assert torch.equal(store.k_scale[layer], ones) and torch.equal(store.v_scale[layer], ones)
        # the last write of each position is the one kept (the warm-up's is overwritten)
        k_new = torch.cat([k for k, _ in written[layer][-NEW:]])
        v_new = torch.cat([v for _, v in written[layer][-NEW:]])
        k8, v8 = store.read(layer)
        assert torch.equal(k8.float(), k_new.clamp(-448, 448).to(torch.float8_e4m3fn).float())
        assert torch.equal(v8.float(), v_new.clamp(-448, 448).to(torch.float8_e4m3fn).float())
        query = torch.randn(1, shape.q_heads, 1, shape.head_dim, generator=gen)
        step = build_layer_step(ctx, layer, query, shape.head_dim ** -0.5)
        out = step(query)  # [1, 1, Hq, D]
        pool = (*(dequantize(t, ones, torch.float64)[None] for t in (k8, v8)), torch.tensor([NEW]))
        ref_out, ref_lse = float64_over_shards(query.transpose(1, 2), [pool], causal=False)
        assert_decode_close(out[:, 0], step.step.lse, ref_out[:, 0], ref_lse[:, 0], tol_for(torch.float32),
                            what=f"layer {layer}")
        step.close()
    # A value past the format's largest saturates at 448 x scale, never NaN.
    big = torch.full((1, shape.kv_heads, shape.head_dim), 1000.0)
    store.write_slots(0, *store.slots(torch.tensor([NEW])), big, -big)
    k8, v8 = store.k[0], store.v[0]
    blk, off = store.slots(torch.tensor([NEW]))
    assert torch.all(k8[blk, off].float() == 448) and torch.all(v8[blk, off].float() == -448)


def test_ring_layer_steps_on_fp8_pools_equal_float64_on_the_dequantized_pools():
    """3 CPU ranks, each with its own fp8 pool and scales (they differ, so a block read with the
    wrong rank's scales shows), the last one's prefill empty and then holding 3 new tokens written
    with its scales: generate's ring layer step (``build_layer_step``, built before the new tokens
    are written) equals float64 attention over the union of the dequantized pools,
    out and lse, for one query token and three causal ones; it sends, per ring step, the block's
    lengths, its K and V pages (1 byte an element) and its owner's scales (8 * Hkv bytes)."""
    from tests.fp8_inputs import dequantize
    from tests.generate.rank_fns import fp8_ring_layer_steps
    from tests.paged_inputs import float64_over_shards
    from tests.tolerances import assert_decode_close, tol_for

    shards, new = (37, 20, 0), 3
    per_rank = launch_ranks(fp8_ring_layer_steps, 3, args=(shards, new, 11), timeout_s=120)
    pools = [rep["pools"] for rep in per_rank]
    hkv, d = pools[0][0][0].shape[1:]
    for layer in range(len(pools[0])):
        assert torch.equal(pools[2][layer][2], torch.full((hkv,), 0.05))
        assert torch.equal(pools[2][layer][3], torch.full((hkv,), 0.02))
        assert not torch.equal(pools[0][layer][2], pools[1][layer][2])
    caps = per_rank[0]["caps"]
    assert caps == [40, 20, 5]
    for sq, query in per_rank[0]["queries"].items():
        q = query.transpose(1, 2)  # [1, Sq, Hq, D]
        for layer in range(len(pools[0])):
            union = [(dequantize(k8, ks)[None], dequantize(v8, vs)[None], torch.tensor([k8.shape[0]]))
                     for k8, v8, ks, vs in (pools[r][layer] for r in range(3))]
            assert [u[2].item() for u in union] == [37, 20, new]
            ref_out, ref_lse = float64_over_shards(q, union, causal=sq > 1)
            for rank, rep in enumerate(per_rank):
                out, lse = rep["steps"][sq][layer]
                assert_decode_close(out, lse.view(1, sq, -1), ref_out, ref_lse, tol_for(torch.float32),
                                    what=f"sq {sq}, layer {layer}, rank {rank}")
                sent = sum(4 + 2 * caps[(rank - s) % 3] * hkv * d + 8 * hkv for s in range(2))
                assert rep["traffic"][sq][layer] == (2 * 4, sent), (sq, layer, rank)
