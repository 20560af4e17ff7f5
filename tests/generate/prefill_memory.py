"""Run by ``test_prefill_memory.py`` in a fresh interpreter (glibc's malloc settings are per
process): one prefill of a random Llama in this process, at world size 1, and its peak resident
memory above the start, beside the capacity arithmetic's activations for it.

    python -m tests.generate.prefill_memory '[{"layers": 2, "tokens": 2048, "rows": 512}, ...]'

prints one JSON line, a list with one record per case (one model each, one after the other):
``measured`` (bytes above the RSS at the start of the measured prefill), ``estimate``
(:func:`tree_attn.cost.capacity.prefill_activation_bytes`), ``threshold_set``.
"""

from __future__ import annotations

import json
import sys

# Sized so that a layer's MLP is its largest phase, and its tensors are MiBs (well above the
# noise of the interpreter's own allocations): H e = 2 KiB and I e = 16 KiB a token in float32.
CONFIG = dict(hidden_size=512, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
              vocab_size=256, max_position_embeddings=8192, rope_theta=10000.0)


def measure(layers: int, tokens: int, rows: int, fix_threshold: bool = True) -> dict:
    import torch
    import transformers

    from tree_attn.commands.generate.hf_attention import use_tree_attention
    from tree_attn.commands.generate.kv_store import PagedKVShard
    from tree_attn.commands.generate.prefill import ShardedPrefill, chunk_mlp, sharded_prefill
    from tree_attn.cost.capacity import ModelDims, prefill_activation_bytes
    from tree_attn.launch.memory import MMAP_THRESHOLD_MIN, MemoryMonitor, set_malloc_mmap_threshold
    from tree_attn.reduce.ring_prefill import plan_ring
    from tree_attn.reduce.zigzag import zigzag

    threshold_set = set_malloc_mmap_threshold(MMAP_THRESHOLD_MIN) if fix_threshold else False
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG, num_hidden_layers=layers)
    with torch.inference_mode():
        model = transformers.LlamaForCausalLM(config).eval()
    use_tree_attention(model)
    chunk_mlp(model, rows)
    store = PagedKVShard.allocate(layers, tokens, CONFIG["num_key_value_heads"], CONFIG["head_dim"],
                                  dtype=torch.float32, device="cpu", page_size=16)
    plan = plan_ring(zigzag(tokens, 1), 0)
    ids = [t % CONFIG["vocab_size"] for t in range(tokens + 1)]
    # A first prefill makes what a first forward leaves allocated for good (the process's part of
    # the estimate, not the activations), and writes the KV pool's pages.
    sharded_prefill(model, ids, ShardedPrefill(store, plan))
    with MemoryMonitor("cpu") as mon:
        sharded_prefill(model, ids, ShardedPrefill(store, plan))
    dims = ModelDims.from_config(config.to_dict())
    return {"measured": mon.result.above_start_bytes, "method": mon.method, "threshold_set": threshold_set,
            "estimate": prefill_activation_bytes(dims, tokens, "float32", mlp_rows=rows)}


if __name__ == "__main__":
    print(json.dumps([measure(**case) for case in json.loads(sys.argv[1])]))
