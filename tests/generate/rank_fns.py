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
