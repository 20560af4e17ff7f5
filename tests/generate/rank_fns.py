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


def fp8_ring_layer_steps(env, shard_tokens: tuple[int, ...], new_tokens: int, seed: int) -> dict:
    """generate's ring layer steps (``build_layer_step``) on fp8 pools, in generate's order.

    Rank r writes ``shard_tokens[r]`` prefill tokens of random K/V into its fp8 pool (per-rank,
    per-head gains: every rank's scales its own); a rank with none takes scales of 1, as the
    prefill gives it (``fix_unset_scales``). The last rank makes room for ``new_tokens`` in
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
    store.fix_unset_scales()
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
