"""One greedy token through the whole model as one step: a CUDA graph on GPUs, eager elsewhere.

gpt-fast makes decoding fast with ``torch.compile(mode="reduce-overhead")``: the token's forward
is captured as a CUDA graph, so a token costs one replay instead of thousands of launches issued
from Python. This does the same with ``torch.cuda.CUDAGraph`` (through
:class:`tree_attn.graphs.CapturedStep`), and the graph holds everything a token does:

- the model's forward on static ``input_ids`` / ``position_ids`` (``[1, 1]`` int64);
- every layer's attention: its prepared step (:mod:`.layer_steps`): the local kernel, the
  merge's kernels and NCCL's sends and receives (or all-reduces);
- the new token's K/V write at a device-tensor position: its page slot is computed on the device
  (``block_table[pos // page]``, ``pos % page``) and ``seq_lens`` advanced there
  (:meth:`.hf_attention.DecodeContext.place_next` / ``advance``);
- the greedy argmax, written to a static ``token``, then copied into ``input_ids`` with the
  positions advanced: each replay feeds the next.

The host replays, waits at most the timeout (:func:`tree_attn.graphs.wait_for`: a replayed NCCL
receive has no watchdog), then reads the token: one sync per token, outside the step; the step
itself never syncs. The same function runs eagerly where nothing is captured (CPU ranks,
``--no-cuda-graph``, the ring baseline, a model that cannot be captured), so the tokens are the
same code's either way.

Read, not run, on transformers 5.24 (Llama, Qwen2, Mistral) with ``use_cache=False``, explicit
``position_ids`` and the registered attention: mask creation exits early for an attention
implementation without a mask function (``masking_utils._preprocess_mask_arguments``), so there is
no mask and no data-dependent shape; ``logits_to_keep=1`` slices by a Python int; RMSNorm, RoPE
(default, linear, llama3, yarn: precomputed frequencies), the MLP and the embedding are plain
tensor ops. The exception: a "dynamic" RoPE compares ``max(position_ids)`` with a Python number
every forward (``dynamic_rope_update``), a host sync; such a model runs eagerly, saying why.

Building is collective on several ranks (the warm-up forward builds every layer's step, and the
capture records NCCL work): every rank builds its token step at the same point.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from ...graphs import CapturedStep, StaticStep
from ...reduce.exchange import Traffic
from .hf_attention import CONTEXT_KWARG, DecodeContext
from .ties import StepTop, step_top

# Why the ring baseline stays eager (as in `run`): each of its steps passes whole KV shards around.
RING_EAGER = "the ring baseline runs eagerly (whole KV shards travel each step)"
GRAPHS_OFF = "CUDA graphs turned off (--no-cuda-graph)"


def graph_blocker(model: Any) -> str | None:
    """Why ``model``'s forward cannot be one CUDA graph, found by reading it; None if nothing is
    known to stop it. A dynamic RoPE reads the positions on the host every forward."""
    for module in model.modules():
        kinds = getattr(module, "rope_type", None)
        for kind in (kinds.values() if isinstance(kinds, dict) else [kinds]):
            if isinstance(kind, str) and "dynamic" in kind:
                return (f"the model's {kind!r} RoPE compares the positions with a Python number every forward "
                        f"(a host sync), which a CUDA graph cannot hold")
    return None


@torch.inference_mode()
def _token(model, ctx: DecodeContext, ids: torch.Tensor, positions: torch.Tensor,
           token: torch.Tensor) -> torch.Tensor:
    """One token on static tensors (what the graph captures): place the new token's slot, run the
    model, take the argmax, feed it back and move one position on. Device work only; no autograd
    (whoever calls it: the C kernel's prepared call takes no tensor that needs a gradient).
    Returns the token's logits ``[vocab]`` (in a graph: its static output, rewritten by each replay)."""
    ctx.place_next()
    logits = model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1,
                   **{CONTEXT_KWARG: ctx}).logits[0, -1]
    token.copy_(torch.argmax(logits))
    ids.copy_(token.view(1, 1))
    positions.add_(1)
    ctx.advance()
    return logits


class TokenStep(StaticStep):
    """Greedy decoding one token per call: ``token = step()`` (an int).

    Args:
        model: a transformers causal LM routed through tree-attn's attention
            (``hf_attention.use_tree_attention``).
        ctx: this rank's decode context (its shard holds the prompt's part; its steps get built
            here).
        first: the input token of the first step; ``start`` its position.
        cuda_graph: capture the step on GPUs (False: eager, as ``--no-cuda-graph``).
        timeout_s: the longest wait for a step on GPUs (None: no bound).
        rank, world_size: this process's rank and the group's size (several ranks: the capture
            records NCCL work, so a failure to capture raises rather than falling back).
        abort: aborts the process group when a wait times out (see ``graphs.CapturedStep``).
        label: the strategy, as errors name it.

    One untimed eager forward builds every layer's prepared step; then, on GPUs, the step is
    captured (after its own warm-up on a side stream). The KV those forwards write lies beyond the
    shard's valid tokens and is overwritten by the first real token. ``captured`` says whether a
    call is a replay, ``why_eager`` why not; ``traffic`` what this rank sends per token (the
    tree's merges; a ring counts into ``ctx.stats`` as it runs). :meth:`close` frees the graph
    (before the process group is destroyed); ``captured``, ``why_eager``, ``close`` and the
    context manager come from :class:`~tree_attn.graphs.StaticStep`.
    """

    def __init__(self, model, ctx: DecodeContext, first: int, start: int, *, cuda_graph: bool = True,
                 timeout_s: float | None = None, rank: int | None = None, world_size: int = 1, abort=None,
                 label: str = "the decode") -> None:
        device = ctx.store.seq_lens.device
        self.ctx, self.first, self.start, self.label = ctx, first, start, label
        self.ids = torch.full((1, 1), first, dtype=torch.int64, device=device)
        self.positions = torch.full((1, 1), start, dtype=torch.int64, device=device)
        self.token = torch.zeros((), dtype=torch.int64, device=device)
        fn = partial(_token, model, ctx, self.ids, self.positions, self.token)
        self._reset()
        fn()  # builds every layer's step (collectively); its KV lands past the valid tokens
        self._reset()
        why = None
        if device.type == "cuda":
            why = GRAPHS_OFF if not cuda_graph else RING_EAGER if ctx.strategy == "ring" else graph_blocker(model)
        self.graph = CapturedStep(fn, device, enabled=why is None, warmup=1, communicates=world_size > 1,
                                  timeout_s=timeout_s, abort=abort, rank=rank, name=f"{label}'s token step")
        if why is not None:
            self.graph.why_eager = why
        self._reset()  # the capture's warm-up moved the state on
        steps = [s for s in ctx.layer_steps(1) if s is not None]
        self.traffic = Traffic(
            messages=sum(s.traffic.messages for s in steps if s.traffic is not None),
            bytes_sent=sum(s.traffic.bytes_sent for s in steps if s.traffic is not None),
            collectives=sum(s.traffic.collectives for s in steps if s.traffic is not None),
        )
        self.calls = 0
        self._logits: torch.Tensor | None = None

    def _reset(self) -> None:
        """Inputs and device state back to where the first real token starts (after warm-ups)."""
        self.ids.fill_(self.first)
        self.positions.fill_(self.start)
        self.ctx.reset()

    def __call__(self) -> int:
        """One token: replay (or run) the step, wait for it (bounded), return the token it chose."""
        self.ctx.check_room(1)
        self._logits = self.graph()
        self.graph.wait(f"{self.label} token {self.calls + 1}")
        self.ctx.grew(1)
        self.calls += 1
        return int(self.token)

    def top(self) -> StepTop:
        """The last token's best logits (:func:`.ties.step_top`), read after the call: what a row
        that parts from this one there is judged by. A device read and a host sync: outside any
        timed span."""
        if self._logits is None:
            raise RuntimeError("no token has been decoded yet")
        return step_top(self._logits)

