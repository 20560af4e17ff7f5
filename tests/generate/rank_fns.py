"""Rank functions of the generate tests (module level, so the spawn start method can pickle them)."""

from __future__ import annotations


def rank_with_flipped_keys(env, spec, strategies, broken_rank):
    """:func:`generate_rank`, except that rank ``broken_rank`` flips its keys along the sequence in
    every layer of its prefill (in its pool and in the blocks it sends): a negative control."""
    from tree_attn.commands.generate import prefill
    from tree_attn.commands.generate.decode import generate_rank

    if env.rank == broken_rank:
        attend = prefill.ShardedPrefill.attend
        prefill.ShardedPrefill.attend = lambda self, layer, q, k, v, scale: attend(self, layer, q, k.flip(2), v, scale)
    return generate_rank(env, spec, strategies)
