"""``tree-attn generate`` at long contexts: per-token latency of tree vs ring vs one process, on
CPU ranks (or GPUs with ``--device cuda``).

For each context length and world size a ``generate`` job: the spawned ranks prefill the prompt
(random ids) sharded (zig-zag, the ring per layer) and each strategy decodes the same tokens; with
the first world size also the reference (transformers alone: its sdpa attention and cache, in a
child) and the one-rank row (the rank code at world size 1, tree-attn's paged kernel). ``prefill_s``
is the job's sharded prefill (its slowest rank). ``--dtype auto`` (the default) is generate's: bf16 on GPUs,
float32 on CPU
ranks. Every row's tokens are checked against the reference's; a row that differs is marked and
the script exits 1. Nothing here asserts a time.

Cases:

- ``small``: the default ``small`` preset (4 layers, 8 query / 2 KV heads, head dim 64);
- ``8b-2layers``: the ``llama-3.1-8b`` preset (Llama-3.1-8B's layer shapes, 32 / 8 heads x 128)
  with 2 layers;
- ``deep-30``: a deep, narrow Llama (30 layers, 9 query / 3 KV heads x 64, hidden 576: the shape
  of a small trained checkpoint) with random weights from a seed, written as a checkpoint to a
  temporary folder: the per-token cost of 30 layers' attention calls.

``--worlds 0`` decodes the one-process rows only (the reference and one rank). On GPUs
``--compare-eager`` decodes every row twice, each token one CUDA graph replay and eagerly
(``--no-cuda-graph``), and ``--kernel-time`` profiles the one-rank row's token step: per-token
wall time against the sum of its kernels' device time (torch.profiler), in this process.

    python benchmarks/bench_generate.py --case small --ctx 8192 --ctx 16384 --ctx 32768 --ctx 65536
    python benchmarks/bench_generate.py --case 8b-2layers --ctx 65536 --worlds 2 --worlds 4
    python benchmarks/bench_generate.py --case deep-30 --ctx 8192 --worlds 0
    python benchmarks/bench_generate.py --device cuda --case small --ctx 8192 --worlds 1 --compare-eager --kernel-time
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if (_ROOT / "tree_attn").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch

from tree_attn.commands.generate.decode import ONE_RANK, REFERENCE, GenerateSpec, run_generate
from tree_attn.commands.generate.memory import RowChoice
from tree_attn.commands.generate.models import PRESETS, ModelSource
from tree_attn.commands.generate.ties import NearTie, near_tie
from tree_attn.dtypes import parse_dtype, torch_dtype
from tree_attn.files import atomic_write_text, exit_if_unwritable
from tree_attn.launch.setup import LaunchSetup, default_dtype
from tree_attn.reduce.plan import ReductionPlan

CASES = {"small": ModelSource(preset="small"), "8b-2layers": ModelSource(preset="llama-3.1-8b", layers=2),
         "deep-30": None}
DEEP_30 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=4096, rope_theta=100000.0,
               max_position_embeddings=262144, initializer_range=0.3, tie_word_embeddings=True)


def _deep_checkpoint(folder: str, seed: int = 0) -> ModelSource:
    """The ``deep-30`` model, seeded, saved as a checkpoint in ``folder`` (ranks load it by path)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**DEEP_30))
    model.save_pretrained(folder, safe_serialization=True)
    return ModelSource(path=folder)


def _kernel_time(source: ModelSource, prompt, new_tokens: int, dtype: str, device: str = "cuda") -> dict:
    """GPU: the one-rank row's token step (CUDA graph): per-token wall time (replay and read-back,
    timed without the profiler) against the sum of the device time of the kernels a token runs
    (the same step profiled, and the same token's kernels launched eagerly). ``device="cpu"``
    runs the same code eagerly with no kernel time (tests/test_gpu_checks.py: its code paths on
    a machine without a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    from tree_attn.commands.generate.decode import ModelShape
    from tree_attn.commands.generate.hf_attention import DecodeContext, use_tree_attention
    from tree_attn.commands.generate.kv_store import PagedKVShard
    from tree_attn.commands.generate.models import build_model
    from tree_attn.commands.generate.prefill import ShardedPrefill, chunk_mlp, sharded_prefill
    from tree_attn.commands.generate.token_step import TokenStep
    from tree_attn.dtypes import torch_dtype
    from tree_attn.reduce.ring_prefill import plan_ring
    from tree_attn.reduce.zigzag import zigzag

    device = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
    on_gpu = device.type == "cuda"
    dtype = torch_dtype(dtype)
    model = build_model(source, dtype=dtype, device=device)
    use_tree_attention(model)
    chunk_mlp(model)
    with torch.inference_mode():
        n = len(prompt) - 1  # the one-rank row's prefill: generate's sharded prefill at world size 1
        shape = ModelShape.from_config(model.config.to_dict())
        # room: the graph's warm-up, timed and profiled tokens, then the eager step's (its build,
        # warm and profiled tokens), each step's build forwards written past the valid tokens
        room = new_tokens // 2 + 2 * new_tokens + 1 + EAGER_PROFILED + 4
        store = PagedKVShard.allocate(shape.layers, n + room, shape.kv_heads, shape.head_dim,
                                      dtype=dtype, device=device)
        sharded_prefill(model, prompt, ShardedPrefill(store, plan_ring(zigzag(n, 1), 0)))
        ctx = DecodeContext(store, "local", holds_new=True)
        step = TokenStep(model, ctx, prompt[-1], store.length, timeout_s=600.0)
        try:
            for _ in range(new_tokens // 2):  # warm
                step()
            walls = []  # timed without the profiler, whose own work per token would count as wall
            for _ in range(new_tokens):
                if on_gpu:
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                step()
                walls.append(time.perf_counter() - t0)
            with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
                for _ in range(new_tokens):
                    step()
            events = _device_events(prof)
            device_s = sum(e.device_time_total for e in events) * 1e-6 / new_tokens  # microseconds
            captured, why = step.captured, step.why_eager
            step.close()
            # The same token's kernels launched one by one (no graph): their device time is the
            # sum to compare with where the profiler does not trace inside graph replays, and a
            # check on the graph's own sum where it does. Goes on after the graph's tokens.
            eager = TokenStep(model, ctx, prompt[-1], store.length, cuda_graph=False, timeout_s=600.0)
            try:
                eager()  # warm
                with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
                    for _ in range(EAGER_PROFILED):
                        eager()
                eager_events = _device_events(prof)
            finally:
                eager.close()
        finally:
            step.close()
            ctx.close()
    wall_s = sorted(walls)[len(walls) // 2]
    eager_s = sum(e.device_time_total for e in eager_events) * 1e-6 / EAGER_PROFILED
    return dict(captured=captured, why_eager=why, token_median_ms=1e3 * wall_s, kernels_device_ms=1e3 * device_s,
                wall_over_kernels=wall_s / device_s if device_s > 0 else None,
                kernels_per_token=len(events) / new_tokens,
                eager_kernels_device_ms=1e3 * eager_s, eager_kernels_per_token=len(eager_events) / EAGER_PROFILED,
                wall_over_eager_kernels=wall_s / eager_s if eager_s > 0 else None)


EAGER_PROFILED = 4  # eager tokens profiled for their kernels' device time


def _device_events(prof) -> list:
    """The profiler's device-side (CUDA kernel and memcpy/memset) events."""
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _profile_line(p: dict) -> str:
    """One line of a ``_kernel_time`` result; says so when the profiler saw no kernel (a CUPTI
    that does not trace inside graph replays would leave the ratio undefined, not 0)."""
    line = (f"one-rank token step at {p['context']:,}: {'graph' if p['captured'] else 'eager'}, "
            f"{p['token_median_ms']:.3f} ms per token, kernels {p['kernels_device_ms']:.3f} ms of device time "
            f"({p['kernels_per_token']:.0f} per token): ")
    if p["wall_over_kernels"] is None:
        line += "wall/kernels not measured in the replays: the profiler recorded no kernel time"
    else:
        line += f"wall/kernels {p['wall_over_kernels']:.2f}x (goal <= 1.1x)"
    if p.get("wall_over_eager_kernels") is not None:
        line += (f"; the same token's kernels launched eagerly: {p['eager_kernels_device_ms']:.3f} ms of device time "
                 f"({p['eager_kernels_per_token']:.0f} per token), wall/those {p['wall_over_eager_kernels']:.2f}x")
    return line


def _say(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=sorted(CASES), default="small")
    ap.add_argument("--ctx", type=int, action="append", help="prompt tokens (repeat; default 8192)")
    ap.add_argument("--worlds", type=int, action="append",
                    help="rank counts (repeat; default 2 and 4; 0: the one-process rows only)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on GPUs, float32 on CPU), float32, fp16 or bf16")
    ap.add_argument("--compare-eager", action="store_true",
                    help="GPUs: every row twice, with CUDA graphs and with --no-cuda-graph")
    ap.add_argument("--kernel-time", action="store_true",
                    help="GPUs: profile the one-rank token step (wall vs its kernels' device time)")
    ap.add_argument("--out", default=None, help="JSON file (default benchmarks/out/generate-<case>.json)")
    args = ap.parse_args()
    args.out = Path(args.out) if args.out else _ROOT / "benchmarks" / "out" / f"generate-{args.case}.json"
    exit_if_unwritable(ap, {"--out": args.out})
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_generate: --device cuda, but no CUDA or ROCm GPU is visible (--device cpu runs CPU ranks)")
    contexts = args.ctx or [8192]
    worlds = [w for w in (args.worlds or [2, 4]) if w > 0]
    checkpoint = tempfile.mkdtemp(prefix="tree-attn-bench-model-") if args.case == "deep-30" else None
    source = CASES[args.case] or _deep_checkpoint(checkpoint)
    vocab = DEEP_30["vocab_size"] if checkpoint else PRESETS[source.preset]["vocab_size"]
    graph_modes = [True, False] if args.device == "cuda" and args.compare_eager else [None]
    try:
        return _run(args, contexts, worlds, source, vocab, graph_modes)
    finally:
        if checkpoint:
            shutil.rmtree(checkpoint, ignore_errors=True)


def _run(args, contexts, worlds, source, vocab, graph_modes) -> int:
    backend = "nccl" if args.device == "cuda" else "gloo"
    dtype = parse_dtype(default_dtype(args.device) if args.dtype == "auto" else args.dtype)
    device = None  # named by the ranks (this process touches no GPU)
    records = []
    failed = False
    for ctx in contexts:
        prompt = tuple(torch.randint(0, vocab, (ctx,), generator=torch.Generator().manual_seed(ctx)).tolist())
        launch = LaunchSetup(world_size=worlds[0] if worlds else 1, device_kind=args.device, backend=backend,
                             dtype=dtype, timeout_s=600.0, plans=(("tree", ReductionPlan("tree", 2)), ("ring", None)))
        for graphs in graph_modes:
            # cuda_graph only where asked (GPUs), so that this script also measures code without the option
            graph_arg = {} if graphs is None else {"cuda_graph": graphs}
            rows, reference = [], None
            # --worlds 0: one job of one rank that decodes no strategy, for the one-process rows alone
            jobs = [(w, launch.plans) for w in worlds] or [(1, ())]
            for i, (world, plans) in enumerate(jobs):
                # The one-process rows (transformers alone, tree-attn on one rank) once per context.
                first = RowChoice() if i == 0 else RowChoice(False, "skipped: run with the first world size")
                spec = GenerateSpec(source, prompt, dataclasses.replace(launch, world_size=world, plans=plans),
                                    new_tokens=args.new_tokens, reference=first, one_rank=first, **graph_arg)
                print(f"[{args.case}] {ctx:,} tokens: {world} ranks (sharded prefill)", file=sys.stderr, flush=True)
                result = run_generate(spec, _say)
                device, layers = result.device, result.layers
                for r in result.rows:
                    if not r.ran:
                        continue
                    if r.name == REFERENCE:
                        reference = r
                    rows.append((1 if r.name in (REFERENCE, ONE_RANK) else world, r, result.prefill_s))
            ring = {w: r.median_s for w, r, _ in rows if r.name == "ring"}
            for world, r, prefill_s in rows:
                # Exact, or parted from the reference only at a near-tie of its logits (16-bit; ties.py)
                # (the job's own check, r.ok, and against the first job's reference: later jobs run none)
                tie = r.near_tie
                if reference is not None and r.tokens != reference.tokens:
                    tie = near_tie(r.tokens, reference.tokens, reference.top, torch_dtype(dtype), layers=layers,
                                   own_top=r.top)
                same = r.ok and (reference is None or r.tokens == reference.tokens or tie is not None)
                failed |= not same
                records.append(dict(
                    case=args.case, context=ctx, ranks=world, name=r.name, median_ms=1e3 * r.median_s,
                    p95_ms=1e3 * r.p95_s, tokens_per_s=r.tokens_per_s, bytes_per_rank_per_token=r.bytes_per_token,
                    messages_per_rank_per_token=r.messages_per_token, same_tokens=same,
                    near_tie=tie.to_dict() if tie is not None else None,
                    step=getattr(r, "execution", "eager"), why_eager=getattr(r, "why_eager", None),
                    this_over_reference=r.median_s / reference.median_s if reference is not None else None,
                    ring_over_this=(ring[world] / r.median_s) if world in ring else None, prefill_s=prefill_s))
    profiles = []
    if args.device == "cuda" and args.kernel_time:
        for ctx in contexts:
            prompt = tuple(torch.randint(0, vocab, (ctx,), generator=torch.Generator().manual_seed(ctx)).tolist())
            print(f"[{args.case}] {ctx:,} tokens: profiling the one-rank token step", file=sys.stderr, flush=True)
            profiles.append(dict(context=ctx, **_kernel_time(source, prompt, args.new_tokens, dtype)))
            print(f"  {_profile_line(profiles[-1])}", file=sys.stderr, flush=True)  # kept if a limit stops the rest
    print(f"\n{args.case}: {args.new_tokens} tokens per row, {device}, {backend}, {dtype}; per-token latency on rank 0")
    print(f"{'context':>8} {'ranks':>5} {'decode':<10} {'step':<5} {'median ms':>10} {'p95 ms':>9} {'tok/s':>7} "
          f"{'sent/rank/token':>16} {'/reference':>10} {'ring/this':>9} {'same':>5}")
    for rec in records:
        ratio = f"{rec['ring_over_this']:.2f}x" if rec["ring_over_this"] is not None else "-"
        step = "graph" if rec["step"] == "cuda graph" else "eager"
        over = f"{rec['this_over_reference']:.2f}x" if rec["this_over_reference"] is not None else "-"
        print(f"{rec['context']:>8} {rec['ranks']:>5} {rec['name']:<10} {step:<5} {rec['median_ms']:>10.2f} "
              f"{rec['p95_ms']:>9.2f} {rec['tokens_per_s']:>7.1f} {rec['bytes_per_rank_per_token']:>16,} "
              f"{over:>10} {ratio:>9} {'NO' if not rec['same_tokens'] else 'tie' if rec['near_tie'] else 'yes':>5}")
    for rec in records:
        if rec["near_tie"]:
            tie = NearTie(**rec["near_tie"])
            print(f"  {rec['context']} {rec['ranks']} {rec['name']} ({rec['step']}): {tie.describe()}")
    if args.device == "cuda":
        for rec in records:
            if rec["step"] != "cuda graph" and rec["name"] != "reference" and rec["why_eager"]:
                print(f"  {rec['context']} {rec['ranks']} {rec['name']}: eager: {rec['why_eager']}")
    for p in profiles:
        print(_profile_line(p))
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(dict(device=device, backend=backend, dtype=dtype, torch=torch.__version__,
                                   when=time.strftime("%Y-%m-%d %H:%M"), records=records,
                                   kernel_time=profiles), indent=2))
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
