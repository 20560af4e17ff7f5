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
# Low-precision outputs are rounded once to their dtype (bf16: 2^-8 relative).
ERROR_LIMITS = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 2e-2}


@dataclass(frozen=True)
class RunOptions(PlanOptions):
    """What the user asked ``run`` for: the launch and its plans (:class:`PlanOptions`), the
    shape and the steps. These are the defaults of ``tree-attn run`` and of :class:`RunSpec`."""

    seq_len: int = 65536
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
    launch = resolve_launch(options.launch_request(shape=shape))
    spec = RunSpec(
        launch=launch, seq_len=options.seq_len, batch=options.batch, q_heads=options.heads,
        kv_heads=options.kv_heads, head_dim=options.head_dim, steps=options.steps, warmup=options.warmup,
        seed=options.seed, cuda_graph=options.cuda_graph,
    )  # validates the sizes (positive batch, ...) before anything computes with them
    if launch.device_kind == "cpu" and not launch.under_torchrun:
        check_host_memory(launch.world_size, spec.seq_len, spec.batch, spec.kv_heads, spec.head_dim, launch.dtype,
                          any(name == "ring" for name, _ in launch.plans), spec.q_heads)
    return RunSetup(spec)


def error_limit(dtype: str) -> float:
    """Max abs error of a run's output against the reference, by the run's dtype."""
    from ...dtypes import parse_dtype

    return ERROR_LIMITS[parse_dtype(dtype)]


def strategies_beyond_tolerance(result: RunResult, dtype: str) -> list[str]:
    """Labels of the strategies whose output differs from the reference beyond :func:`error_limit`
    (NaN included)."""
    limit = error_limit(dtype)
    return [r.plan for r in result.results if not r.max_abs_err <= limit]


__all__ = ["ERROR_LIMITS", "RunOptions", "RunSetup", "error_limit", "plan_run", "strategies_beyond_tolerance"]
