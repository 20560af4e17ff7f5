"""The reference row of ``tree-attn generate``: transformers alone, in one process.

Transformers' own model with its sdpa attention and its own ``DynamicCache`` prefills the prompt
(all tokens but the last, :data:`~tree_attn.cost.capacity.REFERENCE_CHUNK` tokens per forward, as
a user of transformers would) and decodes greedily from the last prompt token. Nothing of
tree-attn's attention, prefill or cache takes part, so every other row is checked against an
independent computation. It runs in a child process (the launching process computes nothing on a
device, and holds no KV), only where the whole context fits in one process (``--reference``).

With an fp8 KV cache (``--kv-dtype fp8``) the reference's cache is quantized as the ranks'
(:class:`FP8CacheAttention`, written here with torch's own fp8 cast, apart from tree-attn's
quantizer): each layer's K and V per KV head with scale = the prompt's largest ``|value|`` / the
format's largest, a decode step's new token saturating at it; its prompt attention reads the
unquantized K/V, as the ranks' prefill does. So the fp8 rows are checked token for token, as
16-bit rows are, and what quantization does to the tokens is the reference's own business.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...cost.capacity import REFERENCE_CHUNK
from ...dtypes import torch_dtype
from ...kernels.fp8 import is_fp8
from ...launch.job import device_name
from ...launch.memory import MemoryMonitor
from .models import build_model
from .ties import StepTop, step_top

__all__ = ["FP8_REFERENCE", "FP8CacheAttention", "ReferenceReport", "reference_in_child", "reference_work"]


@dataclass
class ReferenceReport:
    """The reference's tokens and step times, its prefill time, its process's peak memory, and each
    step's best logits (``top``: what a row that parts from it there is judged by, :mod:`.ties`)."""

    tokens: list[int]
    step_s: list[float]
    prefill_s: float
    peak_bytes: int
    peak_method: str
    device: str
    pid: int
    top: list[StepTop] = field(default_factory=list)


@torch.inference_mode()
def reference_work(spec, say: Callable[[str], None]) -> ReferenceReport:
    """Load the model (GPU 0 or CPU), prefill the prompt and decode ``spec.new_tokens`` tokens
    with transformers alone. ``spec``: a :class:`~.decode.GenerateSpec`."""
    from transformers import DynamicCache

    device = torch.device("cuda", 0) if spec.device_kind == "cuda" else torch.device("cpu")
    with MemoryMonitor(str(device)) as mem:
        fp8 = FP8CacheAttention(torch_dtype(spec.kv_dtype)) if is_fp8(torch_dtype(spec.kv_dtype)) else None
        say(f"reference: loading {spec.source.label} (transformers, sdpa attention"
            + (f", its cache read as {spec.kv_dtype})" if fp8 is not None else ")"))
        model = build_model(spec.source, dtype=torch_dtype(spec.dtype), device=device)
        if fp8 is not None:
            from transformers import AttentionInterface

            AttentionInterface.register(FP8_REFERENCE, fp8)
            model.set_attn_implementation(FP8_REFERENCE)
        else:
            model.set_attn_implementation("sdpa")
        prompt = list(spec.prompt_ids)
        n = len(prompt) - 1

        def forward(cache, ids: list[int]) -> torch.Tensor:  # the last position's logits [vocab]
            return model(input_ids=torch.tensor([ids], device=device), cache=cache, use_cache=True,
                         logits_to_keep=1).logits[0, -1]

        cache = DynamicCache(config=model.config)
        t0 = time.perf_counter()
        for start in range(0, n, REFERENCE_CHUNK):
            forward(cache, prompt[start:min(n, start + REFERENCE_CHUNK)])
        prefill_s = time.perf_counter() - t0
        say(f"reference: prefilled {n:,} tokens in {prefill_s:.1f} s; decoding {spec.new_tokens} tokens")
        if fp8 is not None:
            fp8.decoding = True  # from here on the cache is read as fp8 (scales from the prompt)
        forward(cache, [prompt[-1]])  # warm-up, as the other rows have; its KV is dropped
        cache.crop(-1)
        token, tokens, steps, top = prompt[-1], [], [], []
        for _ in range(spec.new_tokens):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t1 = time.perf_counter()
            logits = forward(cache, [token])
            token = int(torch.argmax(logits))
            steps.append(time.perf_counter() - t1)
            tokens.append(token)
            top.append(step_top(logits))  # untimed: what a row that parts here is judged by (.ties)
    return ReferenceReport(tokens, steps, prefill_s, mem.result.peak_bytes, mem.method, device_name(str(device)),
                           os.getpid(), top)


FP8_REFERENCE = "tree_attn_fp8_reference"


class FP8CacheAttention:
    """Transformers' sdpa attention over the cache as an fp8 engine stores it (``kv_dtype``: an
    fp8 dtype), registered as an attention implementation. Until :attr:`decoding` is set (the
    prompt's forwards) it attends over the unquantized K/V. At a layer's first call after that its
    scales are fixed from the prompt's K and V (every cached position but the call's own token):
    per KV head ``amax / finfo(kv_dtype).max`` (1 for an all-zero head); every decode call then
    attends over K and V rounded through ``kv_dtype`` with those scales, saturating."""

    def __init__(self, kv_dtype: torch.dtype):
        self.kv_dtype = kv_dtype
        self.top = torch.finfo(kv_dtype).max
        self.decoding = False
        self.scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _through_fp8(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # x [B, Hkv, S, D]
        s = scale.view(1, -1, 1, 1)
        return ((x.float() / s).clamp(-self.top, self.top).to(self.kv_dtype).float() * s).to(x.dtype)

    def _per_head_scale(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.float().abs().amax(dim=(0, 2, 3))
        return torch.where(amax > 0, amax / self.top, torch.ones_like(amax))

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if self.decoding:
            layer = module.layer_idx
            if layer not in self.scales:
                new = query.shape[2]
                self.scales[layer] = (self._per_head_scale(key[:, :, :-new]), self._per_head_scale(value[:, :, :-new]))
            k_scale, v_scale = self.scales[layer]
            key, value = self._through_fp8(key, k_scale), self._through_fp8(value, v_scale)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def reference_in_child(spec, say: Callable[[str], None]) -> ReferenceReport:
    """:func:`reference_work` in a child process that exits before the call returns."""
    from ...launch.child import run_in_child

    return run_in_child(reference_work, (spec,), what="the reference row (transformers alone)",
                        timeout_s=spec.timeout_s, progress=say).value
