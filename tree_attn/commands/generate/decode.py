"""``tree-attn generate``: greedy decoding of a language model with its KV cache sharded over ranks.

A child process (the launching process computes nothing on a device, so it holds no CUDA
context) loads the model and prefills the prompt (all tokens but the last, in chunks); it then
decodes the reference (transformers' own SDPA attention over a ``DynamicCache`` holding the same
prefill KV) and the one-process row (tree-attn's paged kernel, no collective), saves the prefill
KV to a file and exits. The launching process then spawns the ranks, which split the prefill KV
evenly (rank r holds a contiguous slice of the prompt); each rank loads the model, pages its slice
into a :class:`PagedKVShard`, and decodes with each strategy (tree, allreduce, ring) in turn. A
decode step feeds one token through every layer; each layer's attention is a collective over the
ranks' shards, and the new token's K and V are appended to the last rank's shard. Every row starts
from the last prompt token, so all of them decode the same ``new_tokens`` tokens, each by a decode
step, and must match the reference exactly.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...dtypes import torch_dtype
from ...launch.env import RankEnv
from ...launch.group import barrier
from ...launch.job import device_name, percentile, say_on_rank_0
from ...launch.setup import LaunchSetup, OnLaunch
from .hf_attention import CONTEXT_KWARG, DecodeContext, PrefillContext, use_tree_attention
from .kv_store import PagedKVShard
from .models import ModelSource, build_model
from .setup import PREFILL_CHUNK, GenerateOptions

REFERENCE = "reference"
ONE_RANK = "one rank"
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
        return 2 * self.layers * tokens * self.kv_heads * self.head_dim * torch_dtype(dtype).itemsize


@dataclass(frozen=True)
class GenerateSpec(OnLaunch):
    """What to generate and how. ``prompt_ids``: at least one token; ``new_tokens`` decode steps.

    ``launch``: where the ranks compute, their dtype, and the strategies' ``(name, plan)`` pairs
    as in ``run`` (``ring`` has no plan). The reference and the one-process row always run.
    Defaults are :class:`~.setup.GenerateOptions`'.
    """

    source: ModelSource
    prompt_ids: tuple[int, ...]
    launch: LaunchSetup
    new_tokens: int = DEFAULTS.new_tokens
    impl: str = "auto"
    page_size: int = DEFAULTS.page_size
    prefill_chunk: int = PREFILL_CHUNK
    seed: int = DEFAULTS.seed  # shuffles the block tables

    def shard_sizes(self) -> list[int]:
        """Prefill tokens per rank: the prompt minus its last token, split as evenly as possible."""
        return self.launch.shard_sizes(len(self.prompt_ids) - 1)


@dataclass
class StrategyRun:
    """One rank's decode with one strategy: its tokens, step times, bytes and messages per step."""

    tokens: list[int]
    step_s: list[float]
    bytes_per_step: list[int]
    messages_per_step: list[int]


@dataclass
class GenerateRow:
    """One row of the result: a strategy on ``ranks`` ranks (rank 0's tokens and times; bytes and
    messages: the most any rank sent in a step)."""

    name: str
    ranks: int
    tokens: list[int]
    step_s: list[float]
    bytes_per_token: int = 0
    messages_per_token: int = 0
    ranks_agree: bool = True
    matches_reference: bool = True
    text: str | None = None

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def p95_s(self) -> float:
        return percentile(self.step_s, 0.95)

    @property
    def tokens_per_s(self) -> float:
        return len(self.step_s) / sum(self.step_s) if sum(self.step_s) > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "ranks": self.ranks, "median_ms": 1e3 * self.median_s, "p95_ms": 1e3 * self.p95_s,
            "tokens_per_s": self.tokens_per_s, "bytes_per_rank_per_token": self.bytes_per_token,
            "messages_per_rank_per_token": self.messages_per_token, "ranks_agree": self.ranks_agree,
            "matches_reference": self.matches_reference, "tokens": self.tokens, "text": self.text,
            "step_ms": [1e3 * s for s in self.step_s],
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
    profile: Any = None  # commands.run.setup.ProfileChoice, set by the caller
    prompt_text: str | None = None
    shard_sizes: list[int] = field(default_factory=list)

    @property
    def all_match(self) -> bool:
        return all(r.matches_reference and r.ranks_agree for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "random_weights": self.random_weights, "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens, "world_size": self.world_size, "device": self.device,
            "backend": self.backend, "dtype": self.dtype, "page_size": self.page_size,
            "prefill_tokens_per_rank": self.shard_sizes, "new_tokens_rank": self.world_size - 1,
            "prefill_s": self.prefill_s, "all_match_reference": self.all_match,
            "profile": self.profile.to_dict() if hasattr(self.profile, "to_dict") else self.profile,
            "rows": [r.to_dict() for r in self.rows],
        }


# --- the model's forwards --------------------------------------------------------------------

def _positions(start: int, n: int, device) -> torch.Tensor:
    return torch.arange(start, start + n, device=device).view(1, n)


@torch.inference_mode()
def prefill(model, prompt_ids: list[int], chunk: int, progress: Callable[[str], None]) -> PrefillContext:
    """Attend every prompt token but the last, ``chunk`` tokens per forward; keep each layer's KV."""
    shape = ModelShape.from_config(model.config.to_dict())
    device = next(model.parameters()).device
    n = len(prompt_ids) - 1
    ctx = PrefillContext.allocate(shape.layers, n, shape.kv_heads, shape.head_dim,
                                  dtype=next(model.parameters()).dtype, device=device)
    ids = torch.tensor(prompt_ids[:n], dtype=torch.long, device=device).view(1, n)
    last_note = time.monotonic()
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        model.base_model(input_ids=ids[:, start:stop], position_ids=_positions(start, stop - start, device),
                         use_cache=False, **{CONTEXT_KWARG: ctx})
        ctx.length = stop
        if time.monotonic() - last_note > PROGRESS_S or stop == n:
            progress(f"prefill: {stop:,}/{n:,} tokens")
            last_note = time.monotonic()
    return ctx


def _next_token(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits[0, -1]))


@torch.inference_mode()
def decode_tokens(model, ctx: DecodeContext, first: int, start: int, steps: int,
                  progress: Callable[[str], None], label: str) -> StrategyRun:
    """Greedy decode ``steps`` tokens from input token ``first`` at position ``start``.

    One untimed warm-up forward first (it prepares the merge and kernels; its KV is dropped).
    """
    device = ctx.store.k[0].device
    cuda = device.type == "cuda"

    def forward(token: int, pos: int) -> int:
        logits = model(input_ids=torch.tensor([[token]], device=device), position_ids=_positions(pos, 1, device),
                       use_cache=False, logits_to_keep=1, **{CONTEXT_KWARG: ctx}).logits
        return _next_token(logits)  # a host sync: the step is over

    ctx.begin(1)
    forward(first, start)
    ctx.abort()
    run = StrategyRun([], [], [], [])
    token, last_note = first, time.monotonic()
    for i in range(steps):
        ctx.stats.reset()
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        ctx.begin(1)
        token = forward(token, start + i)
        ctx.end()
        run.step_s.append(time.perf_counter() - t0)
        run.tokens.append(token)
        run.bytes_per_step.append(ctx.stats.bytes_sent)
        run.messages_per_step.append(ctx.stats.messages)
        if time.monotonic() - last_note > PROGRESS_S:
            progress(f"{label}: token {i + 1}/{steps}")
            last_note = time.monotonic()
    return run


@torch.inference_mode()
def reference_tokens(model, pre: PrefillContext, first: int, steps: int) -> StrategyRun:
    """The reference: transformers' own SDPA attention and ``DynamicCache``, one process, seeded
    with the prefill's KV; greedy ``steps`` tokens from ``first``."""
    from transformers import DynamicCache

    device = pre.k[0].device
    start = pre.length
    model.set_attn_implementation("sdpa")
    try:
        def fresh_cache():
            cache = DynamicCache(config=model.config)
            if start:
                for layer in range(len(pre.k)):
                    cache.update(pre.k[layer][:, :start].unsqueeze(0), pre.v[layer][:, :start].unsqueeze(0), layer)
            return cache

        def forward(cache, token: int, pos: int) -> int:
            logits = model(input_ids=torch.tensor([[token]], device=device), position_ids=_positions(pos, 1, device),
                           cache=cache, use_cache=True, logits_to_keep=1).logits
            return _next_token(logits)

        forward(fresh_cache(), first, start)  # warm-up, as for the other rows
        cache = fresh_cache()
        run = StrategyRun([], [], [], [])
        token = first
        for i in range(steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            token = forward(cache, token, start + i)
            run.step_s.append(time.perf_counter() - t0)
            run.tokens.append(token)
            run.bytes_per_step.append(0)
            run.messages_per_step.append(0)
        return run
    finally:
        use_tree_attention(model)


# --- ranks -------------------------------------------------------------------------------------

def decode_strategies(env: RankEnv, spec: GenerateSpec, model, k: list[torch.Tensor],
                      v: list[torch.Tensor]) -> dict[str, StrategyRun]:
    """On one rank of an initialised group: page this rank's prefill slice (``k[l], v[l]``
    ``[n_r, Hkv, D]`` per layer) into a shard, then decode with every strategy of ``spec`` from the
    same start. Returns one :class:`StrategyRun` per strategy label."""
    import torch.distributed as dist

    device = torch.device(env.device)
    shape = ModelShape.from_config(model.config.to_dict())
    n = spec.shard_sizes()[env.rank]
    last = env.rank == env.world_size - 1
    store = PagedKVShard.allocate(shape.layers, n + (spec.new_tokens + 1 if last else 0), shape.kv_heads,
                                  shape.head_dim, dtype=torch_dtype(spec.dtype), device=device,
                                  page_size=spec.page_size, seed=spec.seed + env.rank)
    for layer in range(shape.layers):
        store.write(layer, 0, k[layer].to(device), v[layer].to(device))
    capacities: list[Any] = [None] * env.world_size
    dist.all_gather_object(capacities, store.capacity)
    barrier(env)
    first, start = spec.prompt_ids[-1], len(spec.prompt_ids) - 1
    runs: dict[str, StrategyRun] = {}
    for name, plan in spec.plans:
        label = plan.label if plan is not None else "ring"
        store.set_length(n)
        ctx = DecodeContext(store, "ring" if plan is None else "tree", holds_new=last, plan=plan,
                            ring_lengths=capacities, impl=spec.impl, config=spec.kernel_config)
        say_on_rank_0(env, f"{label}: decoding {spec.new_tokens} tokens on {env.world_size} ranks")
        runs[label] = decode_tokens(model, ctx, first, start, spec.new_tokens, lambda t: say_on_rank_0(env, t), label)
        say_on_rank_0(env, f"{label}: median token {1e3 * statistics.median(runs[label].step_s):.2f} ms")
    return runs


PREFILL_FILE = "prefill.pt"


def save_prefill(pre: PrefillContext, folder: str) -> None:
    """Save the prefill KV to ``folder`` as ``{"k": [[Hkv, n, D] per layer], "v": ...}``, from
    which each rank maps its own slice (for any world size: the benchmark splits one prefill over
    several)."""
    n = pre.length
    torch.save({"k": [t[:, :n].contiguous().cpu() for t in pre.k], "v": [t[:, :n].contiguous().cpu() for t in pre.v]},
               os.path.join(folder, PREFILL_FILE))


def load_prefill(folder: str) -> PrefillContext:
    """The prefill saved by :func:`save_prefill`, memory-mapped: a rank reads only its slice."""
    saved = torch.load(os.path.join(folder, PREFILL_FILE), mmap=True, weights_only=True)
    return PrefillContext(k=saved["k"], v=saved["v"], length=saved["k"][0].shape[1] if saved["k"] else 0)


def generate_rank(env: RankEnv, spec: GenerateSpec, folder: str) -> dict[str, StrategyRun]:
    """A spawned rank: load the model and this rank's slice of the prefill in ``folder``, decode."""
    model = build_model(spec.source, dtype=torch_dtype(spec.dtype), device=torch.device(env.device))
    use_tree_attention(model)
    pre = load_prefill(folder)
    sizes = spec.shard_sizes()
    start, n = sum(sizes[:env.rank]), sizes[env.rank]
    mine = [pre.tokens(layer, start, start + n) for layer in range(len(pre.k))]
    return decode_strategies(env, spec, model, [k for k, _ in mine], [v for _, v in mine])


def _row(name: str, ranks: int, runs: list[StrategyRun], reference: list[int] | None) -> GenerateRow:
    mine = runs[0]
    return GenerateRow(
        name=name, ranks=ranks, tokens=mine.tokens, step_s=mine.step_s,
        bytes_per_token=max(max(r.bytes_per_step, default=0) for r in runs),
        messages_per_token=max(max(r.messages_per_step, default=0) for r in runs),
        ranks_agree=all(r.tokens == mine.tokens for r in runs),
        matches_reference=reference is None or mine.tokens == reference,
    )


@dataclass
class OneProcess:
    """What the one-process child computed: the prefill time, the reference and one-rank rows,
    the device's name, and the child's pid (the launching process computes nothing)."""

    prefill_s: float
    rows: list[GenerateRow]
    device: str
    pid: int

    @property
    def reference(self) -> list[int]:
        return self.rows[0].tokens


def load_and_prefill(spec: GenerateSpec, device: torch.device, say: Callable[[str], None]):
    """``(model, prefill KV, seconds)``: the model on ``device``, routed through tree-attn, and the
    prompt prefilled (all tokens but the last)."""
    say(f"loading {spec.source.label}")
    model = build_model(spec.source, dtype=torch_dtype(spec.dtype), device=device)
    use_tree_attention(model)
    t0 = time.perf_counter()
    pre = prefill(model, list(spec.prompt_ids), spec.prefill_chunk, say)
    return model, pre, time.perf_counter() - t0


def one_process_rows(spec: GenerateSpec, model, pre: PrefillContext, say: Callable[[str], None]) -> list[GenerateRow]:
    """The reference row (transformers' sdpa and cache) and the one-rank row (tree-attn's paged
    kernel, no collective), both in this process from the prefill ``pre``."""
    device = pre.k[0].device
    shape = ModelShape.from_config(model.config.to_dict())
    first, start = spec.prompt_ids[-1], pre.length
    say(f"{REFERENCE}: decoding {spec.new_tokens} tokens with transformers' sdpa attention in one process")
    ref = reference_tokens(model, pre, first, spec.new_tokens)
    rows = [_row(REFERENCE, 1, [ref], None)]
    say(f"{ONE_RANK}: decoding with tree-attn's paged kernel in one process")
    local = PagedKVShard.allocate(shape.layers, start + spec.new_tokens + 1, shape.kv_heads, shape.head_dim,
                                  dtype=torch_dtype(spec.dtype), device=device, page_size=spec.page_size,
                                  seed=spec.seed)
    for layer in range(shape.layers):
        local.write(layer, 0, *pre.tokens(layer, 0, start))
    local.set_length(start)
    ctx = DecodeContext(local, "local", holds_new=True, impl=spec.impl, config=spec.kernel_config)
    rows.append(_row(ONE_RANK, 1, [decode_tokens(model, ctx, first, start, spec.new_tokens, say, ONE_RANK)],
                     ref.tokens))
    return rows


def one_process_work(spec: GenerateSpec, folder: str, say: Callable[[str], None]) -> OneProcess:
    """In the child: load the model (GPU 0 or CPU), prefill the prompt, decode the reference and
    the one-rank row, and save the prefill KV to ``folder`` for the ranks."""
    device = torch.device("cuda", 0) if spec.device_kind == "cuda" else torch.device("cpu")
    model, pre, prefill_s = load_and_prefill(spec, device, say)
    rows = one_process_rows(spec, model, pre, say)
    save_prefill(pre, folder)
    return OneProcess(prefill_s, rows, device_name(str(device)), os.getpid())


def decode_in_one_process(spec: GenerateSpec, folder: str, say: Callable[[str], None]) -> OneProcess:
    """:func:`one_process_work` in a child process that exits before any rank starts: the
    launching process makes no CUDA context (about 0.5 GB on GPU 0, which rank 0 uses next, and
    a failure under exclusive-process compute mode). The prefill KV waits in ``folder``."""
    from ...launch.child import run_in_child

    return run_in_child(one_process_work, (spec, folder), what="the one-process rows (prefill, reference, one rank)",
                        timeout_s=spec.timeout_s, progress=say).value


def decode_on_ranks(spec: GenerateSpec, folder: str, reference: list[int],
                    say: Callable[[str], None]) -> list[GenerateRow]:
    """Split the prefill KV in ``folder`` over the launch's spawned ranks; one row per strategy."""
    from ...launch.job import run_ranks

    say(f"spawning {spec.world_size} ranks ({spec.backend}); the new tokens' KV goes to rank {spec.world_size - 1}")
    per_rank = run_ranks(generate_rank, spec.launch, args=(spec, folder)).values
    return [_row(label, spec.world_size, [runs[label] for runs in per_rank], reference) for label in per_rank[0]]


def _result(spec: GenerateSpec, rows: list[GenerateRow], prefill_s: float, device: str, backend: str,
            tokenizer) -> GenerateResult:
    if tokenizer is not None:
        for row in rows:
            row.text = tokenizer.decode(row.tokens)
    return GenerateResult(
        model=spec.source.label, random_weights=spec.source.random_weights, prompt_tokens=len(spec.prompt_ids),
        new_tokens=spec.new_tokens, world_size=spec.world_size, device=device, backend=backend, dtype=spec.dtype,
        page_size=spec.page_size, prefill_s=prefill_s, rows=rows, shard_sizes=spec.shard_sizes(),
    )


def run_generate(spec: GenerateSpec, progress: Callable[[str], None] | None = None,
                 tokenizer=None) -> GenerateResult | None:
    """Generate every row: under torchrun as this process's rank (:func:`_generate_as_torchrun_rank`),
    else the one-process rows in a child, then every strategy on ``spec.world_size`` spawned ranks.
    Returns the rows with the check against the reference (None on torchrun ranks other than 0).
    The launching process only launches and collects: it computes nothing on a device."""
    if spec.launch.torchrun is not None:
        return _generate_as_torchrun_rank(spec, progress, tokenizer)
    say = progress or (lambda text: None)
    folder = tempfile.mkdtemp(prefix="tree-attn-generate-")
    try:
        local = decode_in_one_process(spec, folder, say)
        rows = local.rows + decode_on_ranks(spec, folder, local.reference, say)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return _result(spec, rows, local.prefill_s, local.device, spec.backend, tokenizer)


def _generate_as_torchrun_rank(spec: GenerateSpec, progress: Callable[[str], None] | None = None,
                               tokenizer=None) -> GenerateResult | None:
    """Under torchrun this process is one rank (of a job on one node or several).

    Every rank loads the model and prefills the whole prompt itself (nothing moves between nodes
    for it: the wall time of one prefill, world-size times its compute) and keeps its own slice.
    The ranks then join the group and decode with every strategy. Rank 0 gathers the rows, leaves
    the group, and only then decodes the reference and the one-rank row, so no rank waits in a
    collective for them. Returns the result on rank 0, None elsewhere.
    """
    from ...launch.job import run_ranks

    env = spec.launch.torchrun
    say = progress if (progress is not None and env.rank == 0) else (lambda text: None)
    if env.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(env.device))  # before any CUDA work: this rank's GPU only
    model, pre, prefill_s = load_and_prefill(spec, torch.device(env.device), say)
    sizes = spec.shard_sizes()
    start, n = sum(sizes[:env.rank]), sizes[env.rank]
    mine = [pre.tokens(layer, start, start + n) for layer in range(len(pre.k))]
    k, v = [t.contiguous() for t, _ in mine], [t.contiguous() for _, t in mine]
    if env.rank != 0:
        del pre, mine  # only rank 0 needs the whole prefill again, for its one-process rows
    job = run_ranks(decode_strategies, spec.launch, args=(spec, model, k, v))  # join, decode, gather, leave
    if job is None:
        return None
    local = one_process_rows(spec, model, pre, say)
    gathered = job.values
    rows = local + [_row(label, spec.world_size, [g[label] for g in gathered], local[0].tokens)
                    for label in gathered[0]]
    return _result(spec, rows, prefill_s, job.device, env.backend, tokenizer)
