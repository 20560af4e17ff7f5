"""Route a Hugging Face model's attention through tree-attn, by transformers' attention hook.

:func:`use_tree_attention` registers one function under the name ``"tree_attn"`` in
``transformers.AttentionInterface`` and sets it as the model's attention implementation. The
model's own code computes q, k and v (projections, RoPE) and calls that function in every layer;
the function reads a context passed as the forward's keyword argument ``tree_attn_ctx``:

- a prefill context (:class:`.prefill.ShardedPrefill`, anything with an ``attend`` method): the
  layer's attention is the context's (this rank's queries over the whole prompt, exchanged around
  the ring of ranks), which also keeps the rank's K and V.
- :class:`DecodeContext`: this rank's paged KV shard (:class:`.kv_store.PagedKVShard`); the
  new token's K and V go to the shard that holds new tokens (the last rank's), then the layer's
  attention over all ranks' shards is the layer's step prepared once per session
  (:mod:`.layer_steps`: ``TreeDecodeStep``, ``RingDecodeStep`` or, on one process,
  ``DecodeStep``).

The model is called with ``use_cache=False`` and explicit ``position_ids``: the KV cache lives
here, not in a transformers ``Cache``. No attention mask is built for a registered function
(transformers skips it); causality is known from the positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import ConfigError
from ...reduce.comm import CommStats
from ...reduce.plan import ReductionPlan
from .kv_store import PagedKVShard
from .layer_steps import build_layer_step

ATTENTION_NAME = "tree_attn"
CONTEXT_KWARG = "tree_attn_ctx"
MAX_NEW_PER_FORWARD = 16  # new tokens per decode forward: the decode kernels' Sq limit (a verify step)


@dataclass
class DecodeContext:
    """One rank's decode session with one strategy: what every layer's attention reads.

    ``strategy``: ``tree`` (with ``plan``), ``ring`` (with every rank's pool capacity in
    ``ring_lengths``) or ``local`` (one process, no collective). ``holds_new``: this rank's shard
    receives the new tokens' K and V (the last rank's).

    Each layer's attention is a prepared step (:mod:`.layer_steps`), built on the first forward
    of each query length and reused by every later one. What changes per forward is set once
    for all layers, before it: ``seq_lens`` (shared by the layers), the new tokens' page slots
    (``blocks``, ``offsets``) and which steps serve this query length (``steps``). Two ways in:

    - :meth:`begin` / :meth:`end` around an eager forward of any number of tokens (a verify
      step of several), from the host's count of the shard's tokens;
    - :meth:`place_next` / :meth:`advance` inside the token step (:mod:`.token_step`), from
      ``position``, a device tensor: the slot is computed on the device and ``seq_lens``
      advanced there, so the step holds no number that changes per token and can be one CUDA
      graph. The host then counts the token with :meth:`grew`.

    :meth:`close` frees the steps (call it before the process group goes).
    """

    store: PagedKVShard
    strategy: str
    holds_new: bool
    plan: ReductionPlan | None = None
    ring_lengths: list[int] | None = None
    impl: str = "auto"
    config: Any = None
    stats: CommStats = field(default_factory=CommStats)
    _new: int = 0

    def __post_init__(self) -> None:
        device = self.store.seq_lens.device
        # The shard position of the next new token (on the rank that holds new tokens).
        self.position = torch.full((1,), self.store.length, dtype=torch.int64, device=device)
        self._arange = torch.arange(MAX_NEW_PER_FORWARD, dtype=torch.int64, device=device)
        self._steps: dict[int, list] = {}
        self.steps: list = self._steps_for(1)  # this forward's per-layer steps
        self.writes = False  # this forward writes new K/V into this rank's shard
        self.blocks: torch.Tensor | None = None
        self.offsets: torch.Tensor | None = None

    def _steps_for(self, tokens: int) -> list:
        steps = self._steps.get(tokens)
        if steps is None:
            steps = self._steps[tokens] = [None] * len(self.store.k)
        return steps

    def _place(self, tokens: int) -> None:
        self.blocks, self.offsets = self.store.slots(self.position + self._arange[:tokens])

    def begin(self, new_tokens: int) -> None:
        """Before an eager forward over ``new_tokens`` tokens: make room for them in the shard."""
        if not 1 <= new_tokens <= MAX_NEW_PER_FORWARD:
            raise ConfigError(f"a decode forward takes 1..{MAX_NEW_PER_FORWARD} tokens; got {new_tokens}")
        self._new = new_tokens if self.holds_new else 0
        self.writes = self._new > 0
        if self.writes:
            self.store.check_room(self.store.length, self._new)
            self.position.fill_(self.store.length)
            self._place(self._new)
        self.store.seq_lens.fill_(self.store.length + self._new)
        self.steps = self._steps_for(new_tokens)

    def abort(self) -> None:
        """Drop the tokens of a forward (a warm-up): the shard stays as before :meth:`begin`."""
        self.store.seq_lens.fill_(self.store.length)
        self.position.fill_(self.store.length)
        self._new = 0
        self.writes = False

    def end(self) -> None:
        """After the forward: the new tokens are part of the shard."""
        self.store.set_length(self.store.length + self._new)
        self.position.fill_(self.store.length)
        self._new = 0
        self.writes = False

    def place_next(self) -> None:
        """Device side, before one token's forward (inside the token step's graph): on the rank
        that holds new tokens, ``seq_lens = position + 1`` and the token's slot from ``position``;
        no host number involved."""
        self.steps = self._steps_for(1)
        self.writes = self.holds_new
        if self.holds_new:
            self.store.seq_lens.copy_(self.position + 1)
            self._place(1)

    def advance(self) -> None:
        """Device side, after one token's forward: the next token goes one position further."""
        if self.holds_new:
            self.position.add_(1)

    def check_room(self, tokens: int = 1) -> None:
        """Host side, before a token step: raise unless the shard has room for ``tokens`` more."""
        if self.holds_new:
            self.store.check_room(self.store.length, tokens)

    def grew(self, tokens: int = 1) -> None:
        """Host side, after a token step: count its token (the device state moved by itself)."""
        if self.holds_new:
            self.store.length += tokens

    def reset(self) -> None:
        """Device state back to the host's count (after warm-ups that moved it)."""
        self.store.seq_lens.fill_(self.store.length)
        self.position.fill_(self.store.length)
        self.writes = False

    def layer_steps(self, tokens: int = 1) -> list:
        """The built steps for ``tokens`` query tokens, in layer order (None for layers not built)."""
        return list(self._steps.get(tokens, []))

    def close(self) -> None:
        """Free every prepared step (and what it holds of the process group)."""
        steps, self._steps = self._steps, {}
        self.steps = self._steps_for(1)
        for per_layer in steps.values():
            for step in per_layer:
                if step is not None:
                    step.close()


def _decode(ctx: DecodeContext, layer: int, query, key, value, scale: float) -> torch.Tensor:
    """One layer of a decode forward on this rank: store the new K/V (if this rank holds them) at
    the slots the context set for this forward, then the layer's prepared step (built on the
    first forward of this query length: :func:`.layer_steps.build_layer_step`)."""
    step = ctx.steps[layer]
    if step is None:
        step = ctx.steps[layer] = build_layer_step(ctx, layer, query, scale)
    if ctx.writes:
        ctx.store.write_slots(layer, ctx.blocks, ctx.offsets, key[0].transpose(0, 1), value[0].transpose(0, 1))
    return step(query)


def tree_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function registered as ``"tree_attn"``: transformers' attention-interface signature.

    query ``[B, Hq, S, D]``, key/value ``[B, Hkv, S, D]`` (this forward's tokens, RoPE applied).
    Returns ``(out [B, S, Hq, D], None)``.
    """
    ctx = kwargs.get(CONTEXT_KWARG)
    if ctx is None:
        raise ConfigError(f"the {ATTENTION_NAME!r} attention needs the forward's {CONTEXT_KWARG}= argument")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = module.layer_idx
    attend = getattr(ctx, "attend", None)
    if attend is not None:  # a prefill context
        return attend(layer, query, key, value, scale), None
    return _decode(ctx, layer, query, key, value, scale), None


def use_tree_attention(model) -> None:
    """Register the hook (once per process) and route ``model``'s attention through it."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, tree_attention_forward)
    model.set_attn_implementation(ATTENTION_NAME)
