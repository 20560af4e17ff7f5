"""``tree-attn run``: the decode benchmark (setup, the ranks' decode, the sweep over lengths)."""
