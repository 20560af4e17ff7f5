"""Whether a generate fits, decided before anything loads: the capacity arithmetic of
:mod:`tree_attn.cost.capacity` applied to this job, against the memory this machine has free.

- GPU ranks: each rank's estimate against the free memory of the GPUs, read through NVML in the
  launching process (which must not initialise CUDA: a context there would cost rank 0 memory on
  GPU 0, and fail under exclusive-process compute mode). Which NVML device a CUDA index names
  depends on ``CUDA_DEVICE_ORDER``, so every rank is held to the least free memory of the visible
  GPUs. No NVML (no driver binding, ROCm): the check is skipped, and said so.
- CPU ranks: all processes of the node share the host's available memory (``MemAvailable``): the
  ranks of this node, and (spawned) the launching process.

A prompt that cannot fit is refused in one line that gives the largest prompt that fits with this
world size and with 2x and 4x the ranks. The one-process rows (transformers' reference, tree-attn
on one rank) follow ``--reference``: ``auto`` runs each when it fits in one process, ``on``
refuses the job when one does not, ``off`` skips both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...cost.capacity import LAUNCHER_BYTES, GiB, ModelDims, RankMemory, largest_prompt, rank_memory, reference_memory
from ...errors import ConfigError
from ...launch.gpus import gpu_free_bytes
from ...reduce.zigzag import zigzag

REFERENCE_MODES = ("auto", "on", "off")

__all__ = ["REFERENCE_MODES", "Budget", "GenerateEstimate", "RowChoice", "estimate_generate", "read_budget"]


@dataclass(frozen=True)
class RowChoice:
    """Whether a one-process row runs, and if not, why (the row's text in the table)."""

    runs: bool = True
    reason: str | None = None


@dataclass(frozen=True)
class Budget:
    """Memory the job may use. GPUs: ``per_device`` bytes free on each rank's device (the least
    of the visible GPUs'); CPU ranks: ``shared`` bytes for every process of the node. None:
    unknown (not checked). ``source`` says where the figure comes from."""

    device_kind: str
    per_device: int | None = None
    shared: int | None = None
    source: str = "unknown"

    @property
    def known(self) -> bool:
        return (self.per_device if self.device_kind == "cuda" else self.shared) is not None

    def to_dict(self) -> dict[str, Any]:
        return {"device_kind": self.device_kind, "free_per_device": self.per_device, "host_available": self.shared,
                "source": self.source}


def read_budget(device_kind: str) -> Budget:
    """This machine's free memory for a job on ``device_kind`` (see the module)."""
    if device_kind == "cuda":
        free = gpu_free_bytes()
        return Budget("cuda", per_device=free, source="NVML free memory" if free is not None else "unknown (no NVML)")
    from ...launch.memory import available_host_bytes

    have = available_host_bytes()
    return Budget("cpu", shared=have, source="host MemAvailable" if have is not None else "unknown")


@dataclass(frozen=True)
class GenerateEstimate:
    """The estimate of a generate: each rank's memory, the one-process rows', the budget."""

    ranks: tuple[RankMemory, ...]
    one_rank: RankMemory
    reference: RankMemory
    budget: Budget
    ranks_per_node: int
    spawned: bool

    def job_bytes(self) -> int:
        """What the sharded job needs of the budget: the largest rank (GPUs, each on its own
        device), or the node's ranks and the launching process together (CPU)."""
        if self.budget.device_kind == "cuda":
            return max(r.total for r in self.ranks)
        node = sorted((r.total for r in self.ranks), reverse=True)[:self.ranks_per_node]
        return sum(node) + (LAUNCHER_BYTES if self.spawned else 0)

    def one_process_bytes(self, row: RankMemory) -> int:
        return row.total + (LAUNCHER_BYTES if self.spawned and self.budget.device_kind == "cpu" else 0)

    def available(self) -> int | None:
        return self.budget.per_device if self.budget.device_kind == "cuda" else self.budget.shared

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": [r.to_dict() for r in self.ranks], "one_rank": self.one_rank.to_dict(),
                "reference": self.reference.to_dict(), "budget": self.budget.to_dict(),
                "job_bytes": self.job_bytes(), "ranks_per_node": self.ranks_per_node}


@dataclass(frozen=True)
class JobShape:
    """What the estimate depends on, besides the prompt's length and the world size."""

    dims: ModelDims
    new_tokens: int
    dtype: str
    kv_dtype: str
    device_kind: str
    page_size: int
    preset: bool
    ring_decode: bool

    def ranks(self, prompt_tokens: int, world: int) -> tuple[RankMemory, ...]:
        shares = zigzag(max(prompt_tokens - 1, 0), world).sizes()
        return tuple(rank_memory(self.dims, shares=shares, rank=r, new_tokens=self.new_tokens, dtype=self.dtype,
                                 kv_dtype=self.kv_dtype, device_kind=self.device_kind, page_size=self.page_size,
                                 preset=self.preset, ring_decode=self.ring_decode) for r in range(world))


def estimate_generate(shape: JobShape, prompt_tokens: int, world: int, budget: Budget, ranks_per_node: int,
                      spawned: bool) -> GenerateEstimate:
    one = shape.ranks(prompt_tokens, 1)[0]
    ref = reference_memory(shape.dims, prompt_tokens=prompt_tokens, new_tokens=shape.new_tokens, dtype=shape.dtype,
                           device_kind=shape.device_kind, preset=shape.preset)
    return GenerateEstimate(shape.ranks(prompt_tokens, world), one, ref, budget, ranks_per_node, spawned)


def _gib(b: int) -> str:
    return f"{b / GiB:,.1f} GiB"


def check_job_fits(shape: JobShape, est: GenerateEstimate, prompt_tokens: int, world: int, limit: int) -> None:
    """Refuse, in one line, a prompt whose sharded job cannot fit; name the largest that would,
    on ``world``, 2x and 4x the ranks (the same GPUs, or the same host)."""
    have = est.available()
    if have is None or est.job_bytes() <= have:
        return

    def fits_with(factor: int):
        # GPUs: more GPUs like these, each rank on its own. CPU ranks: more ranks on each node,
        # sharing its memory (each holds a copy of the weights: more ranks may hold less).
        ranks, per_node = factor * world, factor * est.ranks_per_node

        def fits(tokens: int) -> bool:
            trial = GenerateEstimate(shape.ranks(tokens, ranks), est.one_rank, est.reference, est.budget, per_node,
                                     est.spawned)
            return trial.job_bytes() <= have
        return fits

    best = [(f * world, largest_prompt(fits_with(f), limit)) for f in (1, 2, 4)]
    where = f"each of {world} GPUs" if shape.device_kind == "cuda" else f"{est.ranks_per_node} CPU ranks together"
    biggest = max(est.ranks, key=lambda r: r.total)
    fits_text = ", ".join(f"{n:,} tokens on {w} ranks" if n else f"none on {w} ranks" for w, n in best)
    if not any(n for _, n in best):  # more ranks do not help: every rank holds the whole model
        fits_text += f" (every rank holds the whole model, {_gib(biggest.weights)} of weights)"
    raise ConfigError(
        f"a {prompt_tokens:,}-token prompt does not fit: {where} need{'s' if shape.device_kind == 'cuda' else ''} "
        f"{_gib(est.job_bytes())} (the largest rank: {biggest.describe()}), {_gib(have)} free "
        f"({est.budget.source}); the largest prompt that fits: {fits_text}")


def choose_rows(mode: str, est: GenerateEstimate) -> tuple[RowChoice, RowChoice]:
    """``(reference, one rank)`` under ``--reference mode`` (see the module); ConfigError for
    ``on`` when one of them cannot fit in one process."""
    if mode not in REFERENCE_MODES:
        raise ConfigError(f"--reference must be one of {', '.join(REFERENCE_MODES)}; got {mode!r}")
    if mode == "off":
        off = RowChoice(False, "skipped: --reference off")
        return off, off
    have = est.available()
    choices = []
    for name, row in (("the reference (transformers alone)", est.reference), ("the one-rank row", est.one_rank)):
        need = est.one_process_bytes(row)
        if have is None or need <= have:
            choices.append(RowChoice())
            continue
        text = f"needs {_gib(need)} in one process, {_gib(have)} available"
        if mode == "on":
            raise ConfigError(f"--reference on: {name} {text} ({est.budget.source}); use --reference auto to skip it")
        choices.append(RowChoice(False, f"skipped: {text}"))
    return choices[0], choices[1]
