"""``tree-attn tune``: time reduction plans and kernel configs on this machine, write a profile."""
