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
