"""``tree-attn generate``: greedy decoding of a model with its KV cache sharded over ranks."""
