"""Resolve the options of ``tree-attn run`` into a :class:`RunSpec`: the launch (where the ranks
compute, how many, the dtype, the plans, the profile and its kernel config: one
:func:`tree_attn.launch.setup.resolve_launch`), the shape and the steps.

The CLI parses arguments and renders; everything that looks at the machine happens in the launch's
resolution. Nothing is printed: what a user should read comes back as ``notices`` and ``warnings``
of the launch. No torch import at module level (``tree-attn --help`` reads :class:`RunOptions`'
defaults).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...launch.setup import AnnouncesLaunch, PlanOptions
from ..defaults import BATCH, HEAD_DIM, HEADS, KV_HEADS, SEED

if TYPE_CHECKING:  # pragma: no cover
    from .decode import RunResult, RunSpec

# Max abs error of a run's output against the single-process fp32 reference. Inputs are
# unit-variance; the fp32 reference and the distributed result differ only by rounding order.
# Low-precision outputs are rounded once to their dtype (bf16: 2^-8 relative). An fp8 cache's run
# is held to bf16's limit whatever the query's dtype (against float64 on the dequantized cache: the
# GPU kernel feeds P @ V with 16-bit weights), as the tests hold it.
ERROR_LIMITS = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 2e-2}


@dataclass(frozen=True)
class RunOptions(PlanOptions):
    """What the user asked ``run`` for: the launch and its plans (:class:`PlanOptions`), the
    shape and the steps. These are the defaults of ``tree-attn run`` and of :class:`RunSpec`."""

    seq_len: int = 65536
    kv_dtype: str | None = None  # --kv-dtype: the KV cache's (fp8: quantized per rank); None: --dtype
    batch: int = BATCH
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    steps: int = 8
    warmup: int = 2
    seed: int = SEED
    cuda_graph: bool = True


@dataclass(frozen=True)
class RunSetup(AnnouncesLaunch):
    """A resolved run: the spec to decode (the profile, notices and warnings are its launch's)."""

    spec: RunSpec


def plan_run(options: RunOptions) -> RunSetup:
    """Resolve ``options`` against this machine into a :class:`RunSetup`.

    Raises ConfigError for bad options (naming the option), ProfileError for a profile that does
    not apply. Nothing is launched.
    """
    from ...launch.memory import check_host_memory
    from ...launch.setup import KernelShape, resolve_launch
    from .decode import RunSpec

    # The shape first: nothing below may build anything in proportion to a bad number.
    shape = KernelShape(options.heads, options.kv_heads, options.head_dim, options.seq_len)
    launch = resolve_launch(options.launch_request(shape=shape, kv_dtype=options.kv_dtype))
    spec = RunSpec(
        launch=launch, seq_len=options.seq_len, batch=options.batch, q_heads=options.heads,
        kv_heads=options.kv_heads, head_dim=options.head_dim, steps=options.steps, warmup=options.warmup,
        seed=options.seed, cuda_graph=options.cuda_graph,
    )  # validates the sizes (positive batch, ...) before anything computes with them
    if spec.fp8:
        check_fp8_launch(launch)
    if launch.device_kind == "cpu" and not launch.under_torchrun:
        check_host_memory(launch.world_size, spec.seq_len, spec.batch, spec.kv_heads, spec.head_dim, spec.made_dtype,
                          any(name == "ring" for name, _ in launch.plans), spec.q_heads,
                          kv_dtype=launch.kv_dtype)
    return RunSetup(spec)


def check_fp8_launch(launch) -> None:
    """Refuse an fp8 cache this launch cannot run, before anything starts: a torch without fp8
    conversions on CPU (every shard is made and quantized there), or GPU ranks whose devices the
    kernel does not take fp8 on (NVIDIA below compute capability 8.9; ROCm: see
    ``kernels.fp8.ROCM_FP8_DTYPES``). Raises ConfigError or KernelUnavailableError.

    Spawned GPU ranks' capabilities come from NVML (:func:`launch.gpus.gpu_capabilities`), since
    this process must make no CUDA context; where NVML cannot say, each rank refuses its own device
    when it prepares its step. Under torchrun this process is a rank and asks torch."""
    import torch

    from ...dtypes import torch_dtype
    from ...errors import ConfigError
    from ...kernels.device_info import is_rocm
    from ...kernels.fp8 import check_fp8_backend, check_fp8_support

    kv = torch_dtype(launch.kv_dtype)
    check_fp8_support(kv)
    if launch.device_kind != "cuda":
        return
    if launch.under_torchrun:
        from ...launch.env import rank_cuda_device

        check_fp8_backend(kv, torch.device(rank_cuda_device(launch.torchrun.local_rank, torch.cuda.device_count())))
    elif is_rocm():  # the dtype decides there, no device query
        check_fp8_backend(kv, torch.device("cuda:0"))
    else:
        from ...kernels.triton_launch import fp8_unsupported_reason
        from ...launch.gpus import gpu_capabilities

        for capability in (gpu_capabilities() or [None])[:launch.world_size]:
            reason = fp8_unsupported_reason(kv, "cuda", capability)
            if reason is not None:
                raise ConfigError(reason)


def error_limit(dtype: str, kv_dtype: str | None = None) -> float:
    """Max abs error of a run's output against the reference, by the run's dtype (and KV dtype:
    an fp8 cache gets at least bfloat16's limit)."""
    from ...dtypes import is_fp8, parse_dtype

    limit = ERROR_LIMITS[parse_dtype(dtype)]
    return max(limit, ERROR_LIMITS["bfloat16"]) if kv_dtype is not None and is_fp8(kv_dtype) else limit


def strategies_beyond_tolerance(result: RunResult, dtype: str, kv_dtype: str | None = None) -> list[str]:
    """Labels of the strategies whose output differs from the reference beyond :func:`error_limit`
    (NaN included). For an fp8 cache the reference is the dequantized cache's: the quantization's
    own error (``max_abs_err_unquantized``) is reported, not judged."""
    limit = error_limit(dtype, kv_dtype)
    return [r.plan for r in result.results if not r.max_abs_err <= limit]


__all__ = ["ERROR_LIMITS", "RunOptions", "RunSetup", "check_fp8_launch", "error_limit", "plan_run",
           "strategies_beyond_tolerance"]
