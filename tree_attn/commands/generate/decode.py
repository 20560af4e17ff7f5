"""``tree-attn generate``: greedy decoding of a language model whose KV cache no process holds whole.

The launching process starts the ranks and collects; it loads no model and no KV. Each rank loads
the model itself (a checkpoint or a seeded preset) and prefills only its own positions of the
prompt (:mod:`.prefill`: the zig-zag assignment, each layer's attention exchanged around the ring
of ranks), straight into its paged pool. It then decodes with each strategy (tree, allreduce,
ring) in turn: a decode step feeds one token through every layer, each layer's attention a
collective over the ranks' shards, the new token's K and V appended to the last rank's shard
(after its prompt tokens, which all precede the new ones: the causal rule of multi-token verify,
bottom-right aligned on that shard, holds; it is the rank the decode collectives expect them on,
and it holds the fewest prompt tokens). Every row starts from the last prompt token and decodes
the same ``new_tokens`` tokens. Each strategy's decode reads the pool the prefill wrote: every
layer's step is prepared once (:mod:`.layer_steps`) and a token is one :class:`.token_step.TokenStep`
(on GPUs one CUDA graph replay, ``--cuda-graph``; each row says how it ran).

Two rows run in one process, where the whole context fits there (``--reference``): the one-rank
row is the same rank code at world size 1 (its sharded prefill is a plain causal prefill, its
decode tree-attn's paged kernel without a collective), spawned as a job of one rank; the reference
is transformers alone (:mod:`.reference`), in a child process. Rows are checked against the
reference; without it against the one-rank row; without both against each other.

Under torchrun the ranks are torchrun's: the same rank code, nothing but the ring's and the
decode's messages between nodes; rank 0 then runs the one-process rows and reports.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ...dtypes import is_fp8, itemsize, torch_dtype
from ...launch.env import RankEnv
from ...launch.job import percentile, say_on_rank_0
from ...launch.memory import MMAP_THRESHOLD_MAX, MMAP_THRESHOLD_MIN, MemoryMonitor, set_malloc_mmap_threshold
from ...launch.setup import LaunchSetup, OnLaunch
from ...reduce.ring_prefill import plan_ring
from ...reduce.zigzag import SequenceShards, zigzag
from .hf_attention import DecodeContext, use_tree_attention
from .kv_store import PagedKVShard
from .memory import RowChoice
from .models import ModelSource, build_model
from .prefill import PrefillReport, ShardedPrefill, chunk_mlp, sharded_prefill
from .setup import GenerateOptions
from .ties import NearTie, StepTop, near_tie
from .token_step import TokenStep

REFERENCE = "reference"
REFERENCE_EAGER = "transformers' own forward and cache, as transformers runs them"
ONE_RANK = "one rank"
LOCAL = (("local", None),)  # the one-rank row's strategy: tree-attn's kernel, no collective
DEFAULTS = GenerateOptions()
PROGRESS_S = 10.0


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache needs to know of a model: layers, KV heads, head dim, query heads, vocab."""

    layers: int
    kv_heads: int
    head_dim: int
    q_heads: int
    vocab: int
    max_positions: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        return cls(config["num_hidden_layers"], config.get("num_key_value_heads") or heads, head_dim, heads,
                   config["vocab_size"], config.get("max_position_embeddings") or 2**31 - 1)

    def kv_bytes(self, tokens: int, dtype: str) -> int:
        return 2 * self.layers * tokens * self.kv_heads * self.head_dim * itemsize(dtype)


@dataclass(frozen=True)
class GenerateSpec(OnLaunch):
    """What to generate and how. ``prompt_ids``: at least one token; ``new_tokens`` decode steps.

    ``launch``: where the ranks compute, their dtype, and the strategies' ``(name, plan)`` pairs
    as in ``run`` (``ring`` has no plan). ``reference``, ``one_rank``: whether the one-process
    rows run (decided by ``plan_generate`` from ``--reference`` and the capacity estimate, which
    ``estimate`` keeps for the report). Defaults are :class:`~.setup.GenerateOptions`'.
    """

    source: ModelSource
    prompt_ids: tuple[int, ...]
    launch: LaunchSetup
    new_tokens: int = DEFAULTS.new_tokens
    impl: str = "auto"
    page_size: int = DEFAULTS.page_size
    seed: int = DEFAULTS.seed  # shuffles the block tables
    cuda_graph: bool = DEFAULTS.cuda_graph  # GPUs: each token one CUDA graph replay
    reference: RowChoice = RowChoice()  # noqa: RUF009 - frozen: one shared instance is safe
    one_rank: RowChoice = RowChoice()  # noqa: RUF009 - frozen: one shared instance is safe
    estimate: Any = None  # .memory.GenerateEstimate

    @property
    def prefill_tokens(self) -> int:
        """The prompt but its last token (the first decode step feeds that one)."""
        return len(self.prompt_ids) - 1

    def shards(self, world_size: int | None = None) -> SequenceShards:
        """The zig-zag assignment of the prefill tokens over ``world_size`` (default: the launch's) ranks."""
        return zigzag(self.prefill_tokens, world_size or self.world_size)

    def shard_sizes(self) -> list[int]:
        """Prefill tokens per rank."""
        return self.shards().sizes()

    def one_rank_launch(self) -> LaunchSetup:
        """The one-rank row's job: this launch's device and dtype, one spawned rank, no plans."""
        return replace(self.launch, world_size=1, torchrun=None, layout=None, plans=(), profile=None)


@dataclass
class StrategyRun:
    """One rank's decode with one strategy: its tokens, step times, bytes and messages per step,
    and how a token ran (``"cuda graph"``: one replay; ``"eager"``: op by op, ``why_eager`` says
    why)."""

    tokens: list[int]
    step_s: list[float]
    bytes_per_step: list[int]
    messages_per_step: list[int]
    execution: str = "eager"
    why_eager: str | None = None
    top: list[StepTop] = field(default_factory=list)  # each token's best logits (every rank, untimed; .ties)


@dataclass
class RankReport:
    """What one rank did: each strategy's decode, its prefill, its KV pool, and its peak memory
    in each phase (host RSS high-water on CPU, ``max_memory_allocated`` on GPUs): loading the
    model, the prefill, the decode; ``start_bytes``: before the model loaded (RSS; 0 on GPUs)."""

    rank: int
    runs: dict[str, StrategyRun]
    prefill: PrefillReport
    kv_bytes: int
    load_peak_bytes: int
    prefill_peak_bytes: int
    decode_peak_bytes: int
    peak_method: str
    start_bytes: int = 0
    layers: int = 0  # the model's (what a near-tie's bound scales with, .ties)

    @property
    def peak_bytes(self) -> int:
        return max(self.load_peak_bytes, self.prefill_peak_bytes, self.decode_peak_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "prefill": self.prefill.to_dict(), "kv_pool_bytes": self.kv_bytes,
                "peak_bytes": self.peak_bytes, "load_peak_bytes": self.load_peak_bytes,
                "prefill_peak_bytes": self.prefill_peak_bytes, "decode_peak_bytes": self.decode_peak_bytes,
                "start_bytes": self.start_bytes, "peak_method": self.peak_method}


@dataclass
class GenerateRow:
    """One row of the result: a strategy on ``ranks`` ranks (rank 0's tokens and times; bytes and
    messages: the most any rank sent in a step). ``matches``: the tokens equal those of the row
    the result is checked against (``GenerateResult.checked_against``). ``skipped``: why a
    one-process row did not run (then it has no tokens). ``quantized``: the row read an fp8 KV
    cache (checked as any row: the reference then reads its cache quantized alike).
    ``same_tokens``: positions equal to the yardstick's. ``near_tie``: where a 16-bit row first
    parted from the yardstick at a near-tie of the yardstick's logits (:mod:`.ties`; the row then
    passes, reported as such). ``top``: the row's best logits per step (rank 0's)."""

    name: str
    ranks: int
    tokens: list[int]
    step_s: list[float]
    bytes_per_token: int = 0
    messages_per_token: int = 0
    ranks_agree: bool = True
    matches: bool = True
    text: str | None = None
    execution: str = "eager"
    why_eager: str | None = None
    skipped: str | None = None
    quantized: bool = False
    same_tokens: int | None = None
    near_tie: NearTie | None = None
    top: list[StepTop] = field(default_factory=list, repr=False)

    @property
    def ran(self) -> bool:
        return self.skipped is None

    @property
    def ok(self) -> bool:
        """The row passes: its ranks agree, and its tokens equal the yardstick's or part from them
        only at a near-tie (:mod:`.ties`)."""
        return self.ranks_agree and (self.matches or self.near_tie is not None)

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s) if self.step_s else float("nan")

    @property
    def p95_s(self) -> float:
        return percentile(self.step_s, 0.95) if self.step_s else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return len(self.step_s) / sum(self.step_s) if sum(self.step_s) > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        if not self.ran:
            return {"name": self.name, "ranks": self.ranks, "skipped": self.skipped}
        return {
            "name": self.name, "ranks": self.ranks, "median_ms": 1e3 * self.median_s, "p95_ms": 1e3 * self.p95_s,
            "tokens_per_s": self.tokens_per_s, "bytes_per_rank_per_token": self.bytes_per_token,
            "messages_per_rank_per_token": self.messages_per_token, "ranks_agree": self.ranks_agree,
            "matches": self.matches, "quantized": self.quantized, "same_tokens": self.same_tokens,
            "near_tie": self.near_tie.to_dict() if self.near_tie is not None else None,
            "tokens": self.tokens, "text": self.text,
            "step_ms": [1e3 * s for s in self.step_s], "execution": self.execution, "why_eager": self.why_eager,
        }


@dataclass
class GenerateResult:
    model: str
    random_weights: bool
    prompt_tokens: int
    new_tokens: int
    world_size: int
    device: str
    backend: str
    dtype: str
    page_size: int
    prefill_s: float
    rows: list[GenerateRow]
    profile: Any = None  # launch.plans.ProfileChoice, set by the caller
    prompt_text: str | None = None
    shard_sizes: list[int] = field(default_factory=list)
    cuda_graph: bool = True  # asked for (GPUs); each row says what ran
    checked_against: str = REFERENCE  # "reference", "one rank", "each other" or "nothing" (one row)
    ranks: list[RankReport] = field(default_factory=list)
    reference_report: Any = None  # .reference.ReferenceReport
    one_rank_report: RankReport | None = None
    estimate: Any = None  # .memory.GenerateEstimate
    launcher_peak_bytes: int | None = None  # the launching process's peak RSS (spawned ranks)
    shards: SequenceShards | None = None
    kv_dtype: str | None = None  # None: the dtype's
    layers: int = 1  # the model's (a near-tie's bound, .ties)

    @property
    def all_match(self) -> bool:
        return all(r.ok for r in self.rows if r.ran)

    @property
    def yardstick(self) -> GenerateRow | None:
        """The row the others were checked against (None: one row ran, nothing was checked)."""
        ran = [r for r in self.rows if r.ran]
        if self.checked_against in (REFERENCE, ONE_RANK):
            return next((r for r in ran if r.name == self.checked_against), None)
        return ran[0] if self.checked_against == "each other" and ran else None

    def to_dict(self) -> dict[str, Any]:
        est = self.estimate
        ranks = []
        for rep in self.ranks:
            item = rep.to_dict()
            if est is not None:
                item["estimate"] = est.ranks[rep.rank].to_dict()
            ranks.append(item)
        one = self.one_rank_report
        ref = self.reference_report
        return {
            "model": self.model, "random_weights": self.random_weights, "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens, "world_size": self.world_size, "device": self.device,
            "backend": self.backend, "dtype": self.dtype, "kv_dtype": self.kv_dtype or self.dtype,
            "page_size": self.page_size,
            "prefill_tokens_per_rank": self.shard_sizes, "new_tokens_rank": self.world_size - 1,
            "assignment": self.shards.to_dict() if self.shards is not None else None,
            "prefill_s": self.prefill_s, "checked_against": self.checked_against, "all_match": self.all_match,
            "cuda_graph": self.cuda_graph,
            "profile": self.profile.to_dict() if hasattr(self.profile, "to_dict") else self.profile,
            "rows": [r.to_dict() for r in self.rows],
            "ranks": ranks,
            "one_rank": None if one is None else {**one.to_dict(), "estimate": est.one_rank.to_dict() if est else None},
            "reference": None if ref is None else {
                "prefill_s": ref.prefill_s, "peak_bytes": ref.peak_bytes, "peak_method": ref.peak_method,
                "estimate": est.reference.to_dict() if est else None},
            "launcher_peak_bytes": self.launcher_peak_bytes,
            "memory_budget": est.budget.to_dict() if est is not None else None,
        }


# --- the model's forwards --------------------------------------------------------------------

def _positions(start: int, n: int, device) -> torch.Tensor:
    return torch.arange(start, start + n, device=device).view(1, n)


def _next_token(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits[0, -1]))


@torch.inference_mode()
def decode_tokens(model, ctx: DecodeContext, first: int, start: int, steps: int,
                  progress: Callable[[str], None], label: str, *, cuda_graph: bool = True,
                  timeout_s: float | None = None, rank: int | None = None, world_size: int = 1,
                  abort: Callable[[], str] | None = None, record_top: bool = False) -> StrategyRun:
    """Greedy decode ``steps`` tokens from input token ``first`` at position ``start``;
    ``record_top``: also each token's best logits (read after the token's timed span), by which
    a row that parts from this one is judged (:mod:`.ties`).

    One :class:`.token_step.TokenStep`: an untimed warm-up forward builds every layer's prepared
    step (collectively on several ranks; its KV is overwritten), then on GPUs the whole token is
    captured as one CUDA graph (``cuda_graph``) and each token is a replay, waited for at most
    ``timeout_s``. Both the token step and the layers' steps are freed before this returns, so
    nothing of them outlives the process group.
    """
    device = ctx.store.seq_lens.device
    cuda = device.type == "cuda"
    run = StrategyRun([], [], [], [])
    step = None
    try:
        step = TokenStep(model, ctx, first, start, cuda_graph=cuda_graph, timeout_s=timeout_s, rank=rank,
                         world_size=world_size, abort=abort, label=label)
        run.execution = "cuda graph" if step.captured else "eager"
        run.why_eager = step.why_eager
        last_note = time.monotonic()
        for i in range(steps):
            ctx.stats.reset()
            if cuda:
                torch.cuda.synchronize(device)  # quick: the last step was waited for
            t0 = time.perf_counter()
            token = step()
            run.step_s.append(time.perf_counter() - t0)
            if record_top:
                run.top.append(step.top())
            ctx.stats.add(step.traffic)  # the merges' (a graph replay runs no Python to count them)
            run.tokens.append(token)
            run.bytes_per_step.append(ctx.stats.bytes_sent)
            run.messages_per_step.append(ctx.stats.messages)
            if time.monotonic() - last_note > PROGRESS_S:
                progress(f"{label}: token {i + 1}/{steps}")
                last_note = time.monotonic()
    finally:
        # Deterministically, before the caller tears the process group down: NCCL's teardown
        # waits for every graph that holds its kernels. While an error propagates, it is the one
        # to report, not a close's.
        failing = sys.exc_info()[1] is not None
        try:
            if step is not None:
                step.close()
            ctx.close()
        except Exception:  # see above: the propagating error is the one to report
            if not failing:
                raise
    return run



# --- ranks -------------------------------------------------------------------------------------

def _label(name: str, plan) -> str:
    return ONE_RANK if name == "local" else plan.label if plan is not None else "ring"


def decode_strategies(env: RankEnv, spec: GenerateSpec, model, store: PagedKVShard,
                      strategies) -> dict[str, StrategyRun]:
    """On one rank of an initialised group whose prefill is in ``store``: decode with every
    ``(name, plan)`` of ``strategies`` from the same start. One :class:`StrategyRun` per label."""
    import torch.distributed as dist

    from ...reduce.collectives import abort_group

    n = store.length
    last = env.rank == env.world_size - 1
    capacities: list[Any] = [store.capacity]
    if any(name == "ring" for name, _ in strategies) and env.world_size > 1:
        capacities = [None] * env.world_size
        dist.all_gather_object(capacities, store.capacity)
    first, start = spec.prompt_ids[-1], spec.prefill_tokens
    runs: dict[str, StrategyRun] = {}
    for name, plan in strategies:
        label = _label(name, plan)
        store.set_length(n)
        strategy = name if name in ("local", "ring") else "tree"
        ctx = DecodeContext(store, strategy, holds_new=last, plan=plan, ring_lengths=capacities, impl=spec.impl,
                            config=spec.kernel_config)
        say_on_rank_0(env, f"{label}: decoding {spec.new_tokens} tokens on {env.world_size} rank"
                           f"{'s' if env.world_size != 1 else ''}")
        runs[label] = decode_tokens(model, ctx, first, start, spec.new_tokens, lambda t: say_on_rank_0(env, t), label,
                                    cuda_graph=spec.cuda_graph, timeout_s=spec.timeout_s, rank=env.rank,
                                    world_size=env.world_size, abort=abort_group, record_top=True)
        say_on_rank_0(env, f"{label}: median token {1e3 * statistics.median(runs[label].step_s):.2f} ms")
    return runs


def generate_rank(env: RankEnv, spec: GenerateSpec, strategies) -> RankReport:
    """A rank: load the model, prefill this rank's positions into its paged pool (every rank
    together, the ring), decode with each of ``strategies`` (``(name, plan)`` pairs; ``local``:
    one rank, no collective)."""
    device = torch.device(env.device)
    host = device.type == "cpu"
    if host:
        # The load and the prefill allocate and free token-sized tensors layer after layer: each
        # goes back to the OS when freed, so the RSS is what the tensors hold (the capacity
        # estimate's terms), not what glibc's heap happened to keep (launch.memory).
        set_malloc_mmap_threshold(MMAP_THRESHOLD_MIN)
    # Three regions one after the other (a monitor resets the high-water mark where it starts).
    with MemoryMonitor(env.device) as load:
        say_on_rank_0(env, f"loading {spec.source.label}")
        model = build_model(spec.source, dtype=torch_dtype(spec.dtype), device=device)
        use_tree_attention(model)
        chunk_mlp(model)
        shape = ModelShape.from_config(model.config.to_dict())
        plan = plan_ring(spec.shards(env.world_size), env.rank)
        last = env.rank == env.world_size - 1
        store = PagedKVShard.allocate(shape.layers, plan.tokens + (spec.new_tokens + 1 if last else 0),
                                      shape.kv_heads, shape.head_dim, dtype=torch_dtype(spec.kv_dtype), device=device,
                                      page_size=spec.page_size, seed=spec.seed + env.rank)
    sizes = plan.sizes
    share = f"{min(sizes):,}" if min(sizes) == max(sizes) else f"{min(sizes):,}-{max(sizes):,}"
    say_on_rank_0(env, f"prefill: {spec.prefill_tokens:,} tokens on one rank" if env.world_size == 1 else
                  f"prefill: {spec.prefill_tokens:,} tokens over {env.world_size} ranks (zig-zag, {share} each)")
    if env.world_size > 1:
        import torch.distributed as dist

        # The ranks start their prefill together: its wall time is the prefill's, not the skew of
        # the ranks' model loading (which the first ring step would otherwise absorb as waiting).
        dist.barrier()
    with MemoryMonitor(env.device) as prefill_mem:
        pre = sharded_prefill(model, spec.prompt_ids, ShardedPrefill(store, plan))
    say_on_rank_0(env, f"prefill: {pre.wall_s:.1f} s (rank 0 waited {pre.timing.wait_s:.1f} s for blocks)")
    if host:
        # A token's buffers (the ring's gathered shards) are the same every token: the heap
        # reuses them below glibc's usual cap, rather than mapping fresh pages each token.
        set_malloc_mmap_threshold(MMAP_THRESHOLD_MAX)
    with MemoryMonitor(env.device) as decode_mem:
        runs = decode_strategies(env, spec, model, store, strategies)
    return RankReport(env.rank, runs, pre, store.nbytes, load.result.peak_bytes, prefill_mem.result.peak_bytes,
                      decode_mem.result.peak_bytes, load.method, load.result.start_bytes, shape.layers)


def _row(name: str, ranks: int, runs: list[StrategyRun], quantized: bool = False) -> GenerateRow:
    mine = runs[0]
    return GenerateRow(quantized=quantized,
        name=name, ranks=ranks, tokens=mine.tokens, step_s=mine.step_s, top=mine.top,
        bytes_per_token=max(max(r.bytes_per_step, default=0) for r in runs),
        messages_per_token=max(max(r.messages_per_step, default=0) for r in runs),
        ranks_agree=all(r.tokens == mine.tokens for r in runs),
        execution=mine.execution, why_eager=mine.why_eager,
    )


def _check(rows: list[GenerateRow], logits_dtype: torch.dtype | None = None, layers: int = 1) -> str:
    """Mark each row's ``matches`` against the yardstick: the reference when it ran, else the
    one-rank row, else the first row that ran. Returns what the rows were checked against. A row
    that parts from the yardstick is checked for a near-tie of the yardstick's own logits (of
    ``logits_dtype``, the model's, of ``layers`` layers; None: exact tokens only),
    :func:`.ties.near_tie`."""
    ran = [r for r in rows if r.ran]
    by_name = {r.name: r for r in ran}
    if REFERENCE in by_name:
        against, yard = REFERENCE, by_name[REFERENCE]
    elif ONE_RANK in by_name:
        against, yard = ONE_RANK, by_name[ONE_RANK]
    elif len(ran) > 1:
        against, yard = "each other", ran[0]
    else:
        return "nothing"
    for r in ran:
        r.matches = r.tokens == yard.tokens
        r.same_tokens = sum(a == b for a, b in zip(r.tokens, yard.tokens, strict=False))
        r.near_tie = None
        if not r.matches and logits_dtype is not None:
            r.near_tie = near_tie(r.tokens, yard.tokens, yard.top, logits_dtype, layers=layers, against=yard.name,
                                  own_top=r.top)
    return against


# --- the job -----------------------------------------------------------------------------------

def run_generate(spec: GenerateSpec, progress: Callable[[str], None] | None = None,
                 tokenizer=None) -> GenerateResult | None:
    """Every row: the sharded job (spawned ranks, or this process's rank under torchrun), then
    the one-process rows that ``spec`` runs. Returns the rows, checked (None on torchrun ranks
    other than 0). The launching process only launches and collects: no model, no KV."""
    from ...launch.job import run_ranks

    torchrun = spec.launch.torchrun
    say = progress if (progress is not None and (torchrun is None or torchrun.rank == 0)) else (lambda text: None)
    with MemoryMonitor("cpu") as launcher:
        if torchrun is None:
            say(f"spawning {spec.world_size} rank{'s' if spec.world_size != 1 else ''} ({spec.backend}); each loads "
                f"the model and prefills its part of the prompt; the new tokens' KV goes to rank {spec.world_size - 1}")
        elif torchrun.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(torchrun.device))  # before any CUDA work: this rank's GPU only
        job = run_ranks(generate_rank, spec.launch, args=(spec, spec.plans))
        if job is None:
            return None
        reports: list[RankReport] = job.values
        if torchrun is not None and torchrun.device.startswith("cuda"):
            torch.cuda.empty_cache()  # rank 0's cached blocks, before a one-process row needs its GPU
        one = None
        if spec.one_rank.runs:
            say(f"{ONE_RANK}: the same rank code on one spawned rank (the whole prefill and KV in one process)")
            one = run_ranks(generate_rank, spec.one_rank_launch(), args=(spec, LOCAL)).values[0]
        ref = None
        if spec.reference.runs:
            from .reference import reference_in_child

            ref = reference_in_child(spec, say)
    rows = [GenerateRow(REFERENCE, 1, ref.tokens, ref.step_s, why_eager=REFERENCE_EAGER, top=ref.top)
            if ref is not None else
            GenerateRow(REFERENCE, 1, [], [], skipped=spec.reference.reason)]
    fp8 = is_fp8(spec.kv_dtype)
    rows.append(_row(ONE_RANK, 1, [one.runs[ONE_RANK]], fp8) if one is not None else
                GenerateRow(ONE_RANK, 1, [], [], skipped=spec.one_rank.reason))
    labels = list(reports[0].runs)
    rows += [_row(label, spec.world_size, [rep.runs[label] for rep in reports], fp8) for label in labels]
    layers = reports[0].layers
    against = _check(rows, torch_dtype(spec.dtype), layers)
    if tokenizer is not None:
        for row in rows:
            if row.ran:
                row.text = tokenizer.decode(row.tokens)
    return GenerateResult(
        model=spec.source.label, random_weights=spec.source.random_weights, prompt_tokens=len(spec.prompt_ids),
        new_tokens=spec.new_tokens, world_size=spec.world_size, device=job.device,
        backend=torchrun.backend if torchrun is not None else spec.backend, dtype=spec.dtype, kv_dtype=spec.kv_dtype,
        page_size=spec.page_size, prefill_s=max(rep.prefill.wall_s for rep in reports), rows=rows,
        shard_sizes=spec.shard_sizes(), cuda_graph=spec.cuda_graph, checked_against=against, ranks=reports,
        reference_report=ref, one_rank_report=one, estimate=spec.estimate, layers=layers,
        launcher_peak_bytes=launcher.result.peak_bytes if torchrun is None else None, shards=spec.shards(),
    )
