"""How close two correct implementations' logits stay in 16 bits: tree-attn's one-rank row
against transformers alone (the reference), greedy, in this process: for each prompt, where the
tokens first part, the largest difference between the two rows' logits (for the tokens both have
among their 8 best) at every step up to the parting, and the gaps there in the reference's and the
row's own logits, all in ulps of the dtype. These are the numbers ``generate``'s near-tie rule
(``tree_attn/commands/generate/ties.py``, ``tie_bound``: 8 x sqrt(layers) ulps) is set against.
Nothing is asserted.

    python benchmarks/logit_agreement.py --preset small --layers 16 --prompt-len 2048 --seeds 6
    python benchmarks/logit_agreement.py --preset llama-3.1-8b --layers 2 --prompt-len 2048 --seeds 3
    python benchmarks/logit_agreement.py --device cuda --prompt-len 8192 --seeds 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if (_ROOT / "tree_attn").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tree_attn.files import atomic_write_text, exit_if_unwritable


def _row_vs_reference(one, ref, dtype, layers: int) -> dict:
    """One prompt: the parting (0-based step or None), the logits' largest disagreement up to it,
    and the two gaps there, in ulps of ``dtype``."""
    from tree_attn.commands.generate.ties import agreement_ulps, near_tie, tie_bound, ulp

    part = next((i for i, (a, b) in enumerate(zip(one.tokens, ref.tokens, strict=True)) if a != b), None)
    worst = agreement_ulps(ref.top, one.top, len(ref.top) if part is None else part + 1, dtype)
    rec = dict(parting=part, agree_ulps=worst, reference_gap_ulps=None, own_gap_ulps=None, tie=None,
               tie_bound_ulps=tie_bound(layers))
    if part is not None:
        t, r = one.tokens[part], ref.tokens[part]
        theirs, mine = ref.top[part].logit_of(r), ref.top[part].logit_of(t)
        own_t, own_r = one.top[part].logit_of(t), one.top[part].logit_of(r)
        if mine is not None:
            rec["reference_gap_ulps"] = (theirs - mine) / ulp(theirs, dtype)
        if own_r is not None:
            rec["own_gap_ulps"] = (own_t - own_r) / ulp(own_t, dtype)
        rec["tie"] = near_tie(one.tokens, ref.tokens, ref.top, dtype, layers=layers, own_top=one.top) is not None
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", help="a generate preset (default small)")
    ap.add_argument("--layers", type=int, default=None, help="layers of the preset (default: its own)")
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=4, help="random prompts, seeds 0..N-1")
    ap.add_argument("--dtype", default="bf16", help="bf16 or fp16 (float32 parts only at exact ties)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", default=None, help="JSON (default benchmarks/out/logit-agreement.json)")
    args = ap.parse_args()
    if args.seeds < 1 or args.prompt_len < 2 or args.new_tokens < 1:
        ap.error("--seeds and --new-tokens must be at least 1, --prompt-len at least 2")
    out = Path(args.out) if args.out else _ROOT / "benchmarks" / "out" / "logit-agreement.json"
    exit_if_unwritable(ap, {"--out": out})

    import torch

    from tree_attn.commands.generate.decode import LOCAL, ONE_RANK, GenerateSpec, generate_rank
    from tree_attn.commands.generate.models import ModelSource
    from tree_attn.commands.generate.reference import reference_work
    from tree_attn.dtypes import parse_dtype, torch_dtype
    from tree_attn.launch.env import RankEnv
    from tree_attn.launch.setup import LaunchSetup

    dtype = parse_dtype(args.dtype)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.exit(2, f"{ap.prog}: error: --device cuda: no GPU here\n")
    source = ModelSource(preset=args.preset, layers=args.layers)
    records = []
    for seed in range(args.seeds):
        ids = torch.randint(0, 4096, (args.prompt_len,), generator=torch.Generator().manual_seed(seed))
        prompt = tuple(ids.tolist())
        spec = GenerateSpec(source, prompt, LaunchSetup(world_size=1, plans=(), device_kind=args.device, dtype=dtype),
                            new_tokens=args.new_tokens)
        say = lambda text: print(f"  [{seed}] {text}", file=sys.stderr, flush=True)  # noqa: B023
        env = RankEnv(0, 1, "gloo", "cpu") if args.device == "cpu" else RankEnv(0, 1, "nccl", "cuda:0")
        report = generate_rank(env, spec, LOCAL)
        ref = reference_work(spec, say)
        records.append(dict(seed=seed, layers=report.layers,
                            **_row_vs_reference(report.runs[ONE_RANK], ref, torch_dtype(dtype), report.layers)))
        r = records[-1]
        say(f"parting at {r['parting']}, logits agree within {r['agree_ulps']:.1f} ulps")
    print(f"\n{source.label}, {args.prompt_len:,}-token prompts, {args.new_tokens} new tokens, {dtype}, {args.device}: "
          f"the one-rank row against transformers alone (ulps of the dtype; ties within "
          f"{records[0]['tie_bound_ulps']:.0f})")
    print(f"{'seed':>4} {'parts at token':>14} {'logits agree within':>20} {'reference gap':>14} {'own gap':>8} "
          f"{'tie':>4}")
    fmt = lambda v: "-" if v is None else f"{v:.1f}"
    for r in records:
        part = "-" if r["parting"] is None else str(r["parting"] + 1)
        tie = "-" if r["tie"] is None else "yes" if r["tie"] else "NO"
        print(f"{r['seed']:>4} {part:>14} {fmt(r['agree_ulps']):>20} {fmt(r['reference_gap_ulps']):>14} "
              f"{fmt(r['own_gap_ulps']):>8} {tie:>4}")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(dict(model=source.label, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                           dtype=dtype, device=args.device, torch=torch.__version__,
                                           when=time.strftime("%Y-%m-%d %H:%M"), records=records), indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
