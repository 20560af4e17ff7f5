"""The reference row of ``tree-attn generate``: transformers alone, in one process.

Transformers' own model with its sdpa attention and its own ``DynamicCache`` prefills the prompt
(all tokens but the last, :data:`~tree_attn.cost.capacity.REFERENCE_CHUNK` tokens per forward, as
a user of transformers would) and decodes greedily from the last prompt token. Nothing of
tree-attn's attention, prefill or cache takes part, so every other row is checked against an
independent computation. It runs in a child process (the launching process computes nothing on a
device, and holds no KV), only where the whole context fits in one process (``--reference``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...cost.capacity import REFERENCE_CHUNK
from ...dtypes import torch_dtype
from ...launch.job import device_name
from ...launch.memory import MemoryMonitor
from .models import build_model

__all__ = ["ReferenceReport", "reference_in_child", "reference_work"]


@dataclass
class ReferenceReport:
    """The reference's tokens and step times, its prefill time, its process's peak memory."""

    tokens: list[int]
    step_s: list[float]
    prefill_s: float
    peak_bytes: int
    peak_method: str
    device: str
    pid: int


@torch.inference_mode()
def reference_work(spec, say: Callable[[str], None]) -> ReferenceReport:
    """Load the model (GPU 0 or CPU), prefill the prompt and decode ``spec.new_tokens`` tokens
    with transformers alone. ``spec``: a :class:`~.decode.GenerateSpec`."""
    from transformers import DynamicCache

    device = torch.device("cuda", 0) if spec.device_kind == "cuda" else torch.device("cpu")
    with MemoryMonitor(str(device)) as mem:
        say(f"reference: loading {spec.source.label} (transformers, sdpa attention)")
        model = build_model(spec.source, dtype=torch_dtype(spec.dtype), device=device)
        model.set_attn_implementation("sdpa")
        prompt = list(spec.prompt_ids)
        n = len(prompt) - 1

        def forward(cache, ids: list[int]) -> int:
            logits = model(input_ids=torch.tensor([ids], device=device), cache=cache, use_cache=True,
                           logits_to_keep=1).logits
            return int(torch.argmax(logits[0, -1]))

        cache = DynamicCache(config=model.config)
        t0 = time.perf_counter()
        for start in range(0, n, REFERENCE_CHUNK):
            forward(cache, prompt[start:min(n, start + REFERENCE_CHUNK)])
        prefill_s = time.perf_counter() - t0
        say(f"reference: prefilled {n:,} tokens in {prefill_s:.1f} s; decoding {spec.new_tokens} tokens")
        forward(cache, [prompt[-1]])  # warm-up, as the other rows have; its KV is dropped
        cache.crop(-1)
        token, tokens, steps = prompt[-1], [], []
        for _ in range(spec.new_tokens):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t1 = time.perf_counter()
            token = forward(cache, [token])
            steps.append(time.perf_counter() - t1)
            tokens.append(token)
    return ReferenceReport(tokens, steps, prefill_s, mem.result.peak_bytes, mem.method, device_name(str(device)),
                           os.getpid())


def reference_in_child(spec, say: Callable[[str], None]) -> ReferenceReport:
    """:func:`reference_work` in a child process that exits before the call returns."""
    from ...launch.child import run_in_child

    return run_in_child(reference_work, (spec,), what="the reference row (transformers alone)",
                        timeout_s=spec.timeout_s, progress=say).value
