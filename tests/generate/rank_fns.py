"""Rank functions of the generate tests (module level, so the spawn start method can pickle them)."""

from __future__ import annotations

from collections import Counter

from tests.generate.counting import counting_calls


def rank_with_flipped_keys(env, spec, strategies, broken_rank):
    """:func:`generate_rank`, except that rank ``broken_rank`` flips its keys along the sequence in
    every layer of its prefill (in its pool and in the blocks it sends): a negative control."""
    from tree_attn.commands.generate import prefill
    from tree_attn.commands.generate.decode import generate_rank

    if env.rank == broken_rank:
        attend = prefill.ShardedPrefill.attend
        prefill.ShardedPrefill.attend = lambda self, layer, q, k, v, scale: attend(self, layer, q, k.flip(2), v, scale)
    return generate_rank(env, spec, strategies)


def counted_generate_rank(env, spec) -> dict[str, tuple[list[int], dict, dict]]:
    """``generate_rank`` (the sharded prefill, then the decode from the pool it wrote), decoding one
    strategy at a time and counting the builders' and look-ups' calls of the decode only: per
    strategy label, ``(tokens, counts once the token step was built, counts after every token)``."""
    from tree_attn.commands.generate import decode

    real = decode.decode_strategies
    out: dict[str, tuple[list[int], dict, dict]] = {}

    def counted(env, spec, model, store, strategies):
        n, runs = store.length, {}
        for strategy in strategies:
            store.set_length(n)
            with counting_calls() as (counts, built):
                one = real(env, spec, model, store, (strategy,))
                after = Counter(counts)
            (label, run), = one.items()
            assert len(built) == 1, f"{label}: {len(built)} token steps built"
            out[label] = (run.tokens, dict(built[0]), dict(after))
            runs.update(one)
        return runs

    decode.decode_strategies = counted
    try:
        decode.generate_rank(env, spec, spec.plans)
    finally:
        decode.decode_strategies = real
    return out


def scales_agreed_at_prefill(env, tokens_per_rank):
    """Rank r gives ``agree_on_scales`` its own K/V of ``tokens_per_rank[r]`` tokens (0: none),
    drawn from one generator so that every process can rebuild every rank's; returns this rank's
    fixed scales and the scales of the whole prompt (all ranks' tokens together)."""
    import torch

    from tree_attn.commands.generate.kv_store import PagedKVShard
    from tree_attn.commands.generate.prefill import ShardedPrefill
    from tree_attn.kernels.fp8 import E4M3

    g = torch.Generator().manual_seed(11)
    gains = torch.tensor([1.0, 3.0, 0.5])[:, None]
    shards = [(torch.randn(n, 3, 8, generator=g) * gains, torch.randn(n, 3, 8, generator=g)) for n in tokens_per_rank]
    store = PagedKVShard.allocate(2, 32, 3, 8, dtype=E4M3, device="cpu", page_size=4)
    ctx = ShardedPrefill(store, plan=None)
    k, v = shards[env.rank]
    for layer in range(2):
        ctx.agree_on_scales(layer, k * (layer + 1), v)
    whole_k = torch.cat([s[0] for s in shards]).abs().amax(dim=(0, 2))
    whole_v = torch.cat([s[1] for s in shards]).abs().amax(dim=(0, 2))
    return [(store.k_scale[layer], store.v_scale[layer]) for layer in range(2)], (whole_k / 448, whole_v / 448)


def fp8_ring_layer_steps(env, shard_tokens: tuple[int, ...], new_tokens: int, seed: int) -> dict:
    """generate's ring layer steps (``build_layer_step``) on fp8 pools, in generate's order.

    Rank r writes ``shard_tokens[r]`` prefill tokens of random K/V into its fp8 pool (per-rank,
    per-head gains: every rank's scales its own, which the ring API allows, though generate's
    prefill makes them agree); a rank with none gets scales 0.05 (K) and 0.02 (V), fixed before
    the steps are built, as the prefill fixes them. The last rank makes room for ``new_tokens`` in
    ``seq_lens``, then each layer's step is built for Sq = 1 and Sq = ``new_tokens`` (causal),
    and only then are the new tokens written (with the scales the steps already hold), as a
    decode forward does. Returns the queries, each step's ``(out, lse)`` and ``(messages, bytes)``
    per layer, every rank's pool capacity, and this rank's pools read back (float32, exact) with
    their scales."""
    import torch
    import torch.distributed as dist

    from tree_attn.commands.generate.hf_attention import DecodeContext
    from tree_attn.commands.generate.kv_store import PagedKVShard
    from tree_attn.commands.generate.layer_steps import build_layer_step

    layers, hq, hkv, d, page = 2, 4, 2, 16, 5
    last = env.rank == env.world_size - 1
    n = shard_tokens[env.rank]
    g = torch.Generator().manual_seed(seed + env.rank)
    store = PagedKVShard.allocate(layers, n + (new_tokens if last else 0), hkv, d, dtype=torch.float8_e4m3fn,
                                  device="cpu", page_size=page, seed=seed + env.rank)
    for layer in range(layers):
        if n:
            gain = torch.rand(hkv, 1, generator=g) * 4 + 0.1
            store.write(layer, 0, torch.randn(n, hkv, d, generator=g) * gain,
                        torch.randn(n, hkv, d, generator=g) * gain / 4)
        else:  # no token to take scales from: fixed before the steps are built, as the prefill fixes them
            store.set_scales(layer, torch.full((hkv,), 0.05), torch.full((hkv,), 0.02))
    store.set_length(n + (new_tokens if last else 0))  # seq_lens holds the new tokens before the steps
    caps = [None] * env.world_size
    dist.all_gather_object(caps, store.capacity)
    ctx = DecodeContext(store, "ring", holds_new=last, ring_lengths=caps)
    gq = torch.Generator().manual_seed(seed)  # the same queries on every rank
    queries = {sq: torch.randn(1, hq, sq, d, generator=gq) for sq in (1, new_tokens)}
    steps = {sq: [build_layer_step(ctx, layer, queries[sq], d ** -0.5) for layer in range(layers)]
             for sq in queries}
    if last:
        for layer in range(layers):
            store.write(layer, n, 2 * torch.randn(new_tokens, hkv, d, generator=g),
                        torch.randn(new_tokens, hkv, d, generator=g))
    results, traffic = {}, {}
    for sq, per_layer in steps.items():
        results[sq], traffic[sq] = [], []
        for layer, step in enumerate(per_layer):
            ctx.stats.reset()
            out = step(queries[sq]).clone()
            results[sq].append((out, step.step.lse.clone()))
            traffic[sq].append((ctx.stats.messages, ctx.stats.bytes_sent))
            step.close()
    # fp8 values as float32 (exact): fp8 storages do not cross the result pipe
    pools = [(*(t.float() for t in store.read(layer)), store.k_scale[layer], store.v_scale[layer])
             for layer in range(layers)]
    return {"queries": queries, "steps": results, "traffic": traffic, "caps": caps, "pools": pools}
