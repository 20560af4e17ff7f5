"""What a sharded generate needs in memory, per rank, and the longest prompt a box can hold.

Pure arithmetic from a model's ``config.json`` (no weights read, no torch): ``generate`` checks it
before anything loads, ``tree-attn fit`` answers it for a machine the user does not have.

One rank of ``tree-attn generate`` holds, at its peak:

- **weights**: the whole model (every rank has a copy; only the KV cache is sharded): embeddings,
  each layer's attention projections (with Qwen2's q/k/v biases) and gated MLP and two norms,
  the final norm, the LM head unless tied to the embeddings. A preset is built in float32 and
  then cast, so loading one peaks at its float32 size (``load``).
- **KV**: its share of the prompt (the zig-zag assignment's, :mod:`tree_attn.reduce.zigzag`) plus,
  on the last rank, the new tokens, in pages: ``layers x 2 x Hkv x D x itemsize(kv dtype)`` bytes
  per token (the itemsize from the one dtype table, so a new KV dtype is a new row there).
- **activations**: the peak of its prefill forward over its own ``S`` tokens, whichever layer phase
  is largest (:func:`prefill_activation_bytes`): the hidden states (the embeddings' output, which
  the model's forward keeps, the layer's input, the residual, the normed states), q, k and v, the
  ring's K/V blocks (its own packed, the next one arriving), the float32 running state of its
  queries, and the MLP's activation/up/product on one chunk of :data:`MLP_ROWS` tokens; beside it
  the decode step's (ring decode gathers whole layer shards).
- **overhead**: per process, the interpreter, torch and transformers on CPU ranks (measured:
  about 450 MiB resident after importing them); on GPUs the CUDA context and the allocator's
  slack, which ``max_memory_allocated`` does not see but the device's free memory does.

Against: each GPU's free memory (NVML, read without initialising CUDA), or on CPU ranks the
host's available memory, which all ranks of the node and the launching process share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..dtypes import itemsize
from ..errors import ConfigError

GiB = 2**30
MiB = 2**20

# Per process. CPU: the interpreter with torch, transformers and a model class imported is about
# 450 MiB resident (measured on the 2-core CI machine, torch 2.13, transformers 5.24), with gloo's
# buffers and the ranks' threads 500 MiB. GPU: a CUDA context is 300-600 MiB outside torch's
# allocator, plus cuBLAS workspaces and the caching allocator's fragmentation (assumed 1 GiB in all).
CPU_PROCESS_BYTES = 500 * MiB
GPU_PROCESS_BYTES = 1024 * MiB
LAUNCHER_BYTES = 300 * MiB  # the launching process of spawned ranks (torch imported, no model, no KV)

MLP_ROWS = 4096  # tokens per MLP chunk in a prefill forward (commands.generate.prefill)
MERGE_ROWS = 1024  # query rows per merged partial state (reduce.ring_prefill)
QUERY_ROWS = 64  # query rows per float32 score block of the GPUs' prefill attention (kernels.prefill)
REFERENCE_CHUNK = 4096  # prompt tokens per forward of the reference's own prefill

__all__ = ["CPU_PROCESS_BYTES", "GPU_PROCESS_BYTES", "MERGE_ROWS", "MLP_ROWS", "QUERY_ROWS", "ModelDims", "RankMemory",
           "largest_prompt", "prefill_activation_bytes", "rank_memory", "reference_memory"]


def _int(config: dict[str, Any], key: str, default: Any = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"config.json: {key} must be a positive integer; got {value!r}")
    return value


@dataclass(frozen=True)
class ModelDims:
    """The sizes of a Llama-family decoder (Llama, Qwen2, Mistral) that memory depends on."""

    layers: int
    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    max_positions: int | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelDims:
        """From a ``config.json`` dict; ConfigError naming a missing or bad key."""
        heads = _int(config, "num_attention_heads")
        hidden = _int(config, "hidden_size")
        head_dim = config.get("head_dim") or hidden // heads
        max_pos = config.get("max_position_embeddings")
        return cls(
            layers=_int(config, "num_hidden_layers"), hidden=hidden, intermediate=_int(config, "intermediate_size"),
            q_heads=heads, kv_heads=_int(config, "num_key_value_heads", heads), head_dim=int(head_dim),
            vocab=_int(config, "vocab_size"), tied=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
            max_positions=max_pos if isinstance(max_pos, int) and max_pos > 0 else None,
        )

    def params(self) -> int:
        """Parameters of the model (what ``sum(p.numel() for p in model.parameters())`` counts)."""
        h, a, kv = self.hidden, self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * a + 2 * h * kv + a * h + ((a + 2 * kv) if self.qkv_bias else 0)
        per_layer = attn + 3 * h * self.intermediate + 2 * h
        embeds = self.vocab * h * (1 if self.tied else 2)
        return self.layers * per_layer + embeds + h

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """K and V of one token in every layer."""
        return self.layers * 2 * self.kv_heads * self.head_dim * itemsize(kv_dtype)


@dataclass(frozen=True)
class RankMemory:
    """One process's memory by part, bytes. ``load``: the peak while the weights load (a preset
    built in float32 before its cast), before the KV pool exists."""

    weights: int
    kv: int
    activations: int
    overhead: int
    load: int = 0
    tokens: int = 0  # KV tokens it holds (prompt share, plus the new tokens on the last rank)

    @property
    def total(self) -> int:
        return max(self.weights + self.kv + self.activations, self.load) + self.overhead

    def to_dict(self) -> dict[str, int]:
        return {"weights": self.weights, "kv": self.kv, "activations": self.activations, "overhead": self.overhead,
                "load": self.load, "total": self.total, "tokens": self.tokens}

    def describe(self) -> str:
        g = lambda b: f"{b / GiB:,.1f}"
        return (f"{g(self.total)} GiB (weights {g(self.weights)}, KV {g(self.kv)}, activations {g(self.activations)}, "
                f"process {g(self.overhead)})")


def prefill_activation_bytes(dims: ModelDims, tokens: int, dtype: str, *, largest_block: int | None = None,
                             mlp_rows: int = MLP_ROWS, device_kind: str = "cpu") -> int:
    """Peak bytes a rank's prefill forward over its ``tokens`` tokens needs beyond weights and KV.

    The largest of a decoder layer's phases (``e`` the activations' itemsize, per token). Through
    all of them the model's forward holds the embeddings' output (``inputs_embeds``, ``H e``: from
    the second layer on it is not the layer's input, which its caller holds as well) and RoPE's cos
    and sin (``2 D e``). Then:

    - attention, in the hook: the layer's input (its residual) and the normed hidden states
      ``2 H e``, q ``A e``, k and v ``2 K e``, the ring's own packed block and the arriving one
      ``4 K e`` (``largest_block`` tokens for the arriving one), the float32 running state
      ``4 (A + Hq)`` and the output cast to the dtype ``A e``;
    - RoPE: the hidden states, q, k, v and three q-sized temporaries ``3 A e``;
    - the MLP: the layer's input, the residual after attention and the normed input ``3 H e`` per
      token, the output when it is filled chunk by chunk ``H e`` (more than ``mlp_rows`` tokens),
      and ``3 I e`` for one chunk of ``mlp_rows`` tokens: gate's activation, up and their product
      (gate itself is freed once activated; the chunk's output is made after the first two go).
      The residual sum after it (``5 H e`` with the kept states) is smaller while ``I >= H``;
    - the norms: input and residual ``2 H e`` and two float32 temporaries ``8 H`` (one more
      float32 copy ``4 H`` when ``e`` is not 4).

    Measured on CPU ranks, where every freed tensor goes back to the OS
    (:func:`tree_attn.launch.memory.set_malloc_mmap_threshold`): a layer's MLP peaks at these
    terms (within 2%, tests/generate/test_prefill_memory.py) plus about 15 MiB that the first
    forward leaves allocated for good (the process's part), with one layer and with two.

    ``A = Hq D``, ``K = Hkv D``; the merge's float32 temporaries add a fixed ``MERGE_ROWS`` rows.
    On GPUs the attention is the portable blockwise path (:func:`tree_attn.kernels.prefill.attention_blockwise`),
    which adds its float32 output ``4 A`` per token, float32 copies of the block's K and V ``8 K``
    per block token, and float32 score blocks ``Hq x QUERY_ROWS x N`` over the largest block ``N``
    (three counted: the block, logsumexp's temporaries; the mask and the exponent work in place).
    """
    if tokens <= 0:
        return 0
    e = itemsize(dtype)
    h, a, k = dims.hidden, dims.q_heads * dims.head_dim, dims.kv_heads * dims.head_dim
    block = tokens if largest_block is None else max(tokens, largest_block)
    kept = tokens * ((h * e if dims.layers > 1 else 0) + 2 * dims.head_dim * e)
    hidden = 2 * h * e
    attention = tokens * (hidden + a * e + 2 * k * e + 2 * k * e + 4 * (a + dims.q_heads) + a * e) + block * 2 * k * e
    if device_kind == "cuda":
        attention += tokens * 4 * a + block * 8 * k + 3 * 4 * dims.q_heads * min(tokens, QUERY_ROWS) * block
    rope = tokens * (hidden + a * e + 2 * k * e + 3 * a * e)
    mlp = tokens * (4 if tokens > mlp_rows else 3) * h * e + min(tokens, mlp_rows) * 3 * dims.intermediate * e
    norm = tokens * (hidden + 8 * h + (4 * h if e != 4 else 0))
    merge = min(tokens, MERGE_ROWS) * 6 * 4 * a
    return kept + max(attention + merge, rope, mlp, norm)


def decode_activation_bytes(dims: ModelDims, largest_share: int, kv_dtype: str, ring: bool) -> int:
    """Peak bytes of a decode step beside the KV: ring decode gathers this rank's layer shard and
    holds the one arriving (3 layer shards of the largest share); the tree moves states only."""
    if not ring:
        return 0
    return 3 * largest_share * 2 * dims.kv_heads * dims.head_dim * itemsize(kv_dtype)


def _pages(tokens: int, page_size: int) -> int:
    return max(1, -(-tokens // page_size)) * page_size


def rank_memory(dims: ModelDims, *, shares: list[int], rank: int, new_tokens: int, dtype: str, kv_dtype: str,
                device_kind: str, page_size: int, preset: bool, ring_decode: bool) -> RankMemory:
    """Rank ``rank``'s memory in a job whose prompt shares are ``shares`` (prefill tokens per
    rank); the last rank also holds the ``new_tokens`` (and one slot the warm-up step uses)."""
    mine = shares[rank] + (new_tokens + 1 if rank == len(shares) - 1 else 0)
    weights = dims.params() * itemsize(dtype)
    kv = _pages(mine, page_size) * dims.kv_bytes_per_token(kv_dtype)
    act = max(prefill_activation_bytes(dims, shares[rank], dtype, largest_block=max(shares), device_kind=device_kind),
              decode_activation_bytes(dims, max(shares) + new_tokens + 1, kv_dtype, ring_decode))
    load = dims.params() * 4 if preset and device_kind == "cpu" else weights
    overhead = GPU_PROCESS_BYTES if device_kind == "cuda" else CPU_PROCESS_BYTES
    return RankMemory(weights, kv, act, overhead, load, mine)


def reference_memory(dims: ModelDims, *, prompt_tokens: int, new_tokens: int, dtype: str, device_kind: str,
                     preset: bool, chunk: int = REFERENCE_CHUNK) -> RankMemory:
    """The reference row in one process: transformers' own forward with its sdpa attention and
    ``DynamicCache`` (the whole KV in the dtype, which grows by concatenation: one layer twice
    while it grows), prefilling ``chunk`` tokens per forward. Its chunk's activations: the MLP's
    ``3 I e`` and the hidden states per token, and the attention mask of the chunk over the whole
    context (one byte a pair); on CPU also its scores (sdpa's math path materialises ``Hq x chunk
    x N`` float32 scores; on GPUs sdpa's memory-efficient kernel takes the mask and keeps none)."""
    total = prompt_tokens + new_tokens
    e = itemsize(dtype)
    weights = dims.params() * e
    per_token = dims.kv_bytes_per_token(dtype)
    kv = total * per_token + total * per_token // dims.layers
    rows = min(chunk, max(prompt_tokens - 1, 1))
    scores = 4 * dims.q_heads if device_kind == "cpu" else 0
    act = rows * (3 * dims.intermediate * e + 6 * dims.hidden * e) + rows * total * (1 + scores)
    load = dims.params() * 4 if preset and device_kind == "cpu" else weights
    overhead = GPU_PROCESS_BYTES if device_kind == "cuda" else CPU_PROCESS_BYTES
    return RankMemory(weights, kv, act, overhead, load, total)


def largest_prompt(fits: Callable[[int], bool], limit: int) -> int:
    """The largest prompt length in ``1..limit`` for which ``fits`` holds (it must be monotone:
    a longer prompt never needs less), or 0 when even one token does not fit."""
    if not fits(1):
        return 0
    lo, hi = 1, limit
    if fits(hi):
        return hi
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
