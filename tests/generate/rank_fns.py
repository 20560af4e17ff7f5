"""Functions the generate tests run on spawned CPU ranks (importable by the children)."""

from __future__ import annotations

from collections import Counter

from tests.generate.counting import counting_calls


def counted_generate_rank(env, spec, folder: str) -> dict[str, tuple[list[int], dict, dict]]:
    """``generate_rank`` one strategy at a time, counting the builders' and look-ups' calls: per
    strategy label, ``(tokens, counts once the token step was built, counts after every token)``."""
    import dataclasses

    from tree_attn.commands.generate.decode import generate_rank

    out = {}
    for plan in spec.plans:
        one = dataclasses.replace(spec, launch=dataclasses.replace(spec.launch, plans=(plan,)))
        with counting_calls() as (counts, built):
            runs = generate_rank(env, one, folder)
            after = Counter(counts)
        (label, run), = runs.items()
        assert len(built) == 1, f"{label}: {len(built)} token steps built"
        out[label] = (run.tokens, dict(built[0]), dict(after))
    return out
