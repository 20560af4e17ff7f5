"""Generate the built-in profiles: ``python -m tree_attn.profiles.builtin_gen [--check] [--out DIR]``.

Each built-in profile is derived, deterministically, from a recorded topology dump of a real
machine (``tests/fixtures/topology/``), the kernel's napkin model (``cost.kernel``: the
candidate configs of each shape bucket ranked for the card's datasheet spec) and the plan model
(``cost.plan``: every candidate plan priced on the topology's links by the step model). Nothing is timed:
origin ``builtin-model``, every value ``chosen_by: model`` (or ``default``). The ``created`` stamp
is fixed so that regenerating gives byte-identical files; a test checks the shipped files equal
this generator's output, so after changing a model run this module and commit the result.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ..cost.plan import decode_lse_bytes, decode_message_bytes, predict_plan_us
from ..topology.model import P2PStatus, Topology
from .schema import KernelBucket, KernelSection, Machine, PlanCandidate, Profile, Reduction, Versions
from .store import profile_to_yaml

# Fixed so that regenerating gives identical files (the date these profiles were first derived).
BUILTIN_CREATED = "2025-01-01T00:00:00Z"
BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
# The recorded dumps live with the tests (they are test fixtures first); this module is a
# development tool run from a source checkout.
FIXTURES_DIR = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "topology"

# Llama-3.1-8B attention: 32 query heads, 8 KV heads (GQA group 4), head dim 128, bf16; batch 1
# (single-sequence long-context decode), per-rank shards of 8K to 1M positions.
LLAMA_Q_HEADS = 32
LLAMA_KV_HEADS = 8
LLAMA_HEAD_DIM = 128
LLAMA_DTYPE = "bfloat16"
BATCH = 1
SHARD_LENS = tuple(1 << s for s in range(13, 21))  # 8192 .. 1048576


@dataclass(frozen=True)
class BuiltinSpec:
    """How to derive one built-in profile."""

    name: str
    description: str
    topology: Callable[[], Topology]
    device_spec: str | None  # key of cost.devices.KNOWN_DEVICES; None = no kernel buckets (CPU ranks)
    notes: tuple[str, ...] = ()
    default_plan: bool = False  # True: use plan.default_plan instead of the model's pick


def _named(topo: Topology, name: str, *, notes: list[str], p2p: P2PStatus | None = None,
           p2p_reason: str | None = None) -> Topology:
    """The dump's topology with the device name the driver reports (a dump of ``topo -m`` has
    none) and, where the dump cannot tell, the peer-to-peer status the hardware class has."""
    devices = [replace(d, name=name) for d in topo.devices]
    links = list(topo.links)
    if p2p is not None:
        links = [replace(l, p2p=p2p, p2p_reason=p2p_reason) if l.p2p is P2PStatus.UNKNOWN else l for l in links]
    named = f"model-derived: device names set to {name!r}, the name the driver reports for this card"
    return topo.replace(devices=devices, links=links, notes=list(topo.notes) + [named] + notes)


def _dump(name: str) -> Topology:
    from ..topology.dumps import load_dump

    path = FIXTURES_DIR / name
    if not path.is_file():
        raise SystemExit(f"builtin_gen: the recorded dump {name} is not in {FIXTURES_DIR.name}/; "
                         "run from a source checkout")
    return load_dump(path)


def _cpu_topology() -> Topology:
    from ..topology.host import host_topology

    return host_topology(4)


def _rtx4090_topology() -> Topology:
    return _named(
        _dump("rtx4090_8gpu_dual_epyc7542_nvidia-smi_topo_m_whitespace_collapsed.txt"),
        "NVIDIA GeForce RTX 4090",
        notes=[("model-derived: peer-to-peer set to unsupported (nvidia-smi topo -m does not show it; "
                "stock GeForce drivers refuse P2P between RTX 4090s)")],
        p2p=P2PStatus.UNSUPPORTED,
        p2p_reason="model-derived: stock GeForce drivers refuse peer-to-peer on RTX 4090",
    )


def _h100_topology() -> Topology:
    return _named(_dump("h100_sxm5_8gpu_1nic_vm_nvidia-smi_topo_m.txt"), "NVIDIA H100 80GB HBM3", notes=[])


def _mi300x_topology() -> Topology:
    return _named(_dump("mi300x_8gpu_amd-smi_topology.txt"), "AMD Instinct MI300X", notes=[])


BUILTINS: tuple[BuiltinSpec, ...] = (
    BuiltinSpec(
        name="cpu-4-ranks",
        description="4 CPU ranks on one host, talking through gloo (tests, CI, machines without a GPU)",
        topology=_cpu_topology,
        device_spec=None,
        notes=(
            ("CPU ranks run the C decode kernel (kernels/cpu_native.py, compiled once per machine), or torch ops where "
             "it cannot be built or TREE_ATTN_CPU_KERNEL=torch; `tree-attn run` names the one that ran (local_kernel "
             "in --json). No Triton config applies, so there are no kernel buckets."),
            ("plan: the project's default binary tree (reduce.plan.default_plan); the candidates' model "
             "predictions are listed for reference only, gloo message costs are rough guesses."),
        ),
        default_plan=True,
    ),
    BuiltinSpec(
        name="rtx4090-8x-pcie",
        description="8x GeForce RTX 4090 over PCIe without peer-to-peer (2x EPYC 7542, one GPU per NUMA node)",
        topology=_rtx4090_topology,
        device_spec="rtx4090",
        notes=(
            ("model-derived, not measured: peer-to-peer is assumed unsupported (stock GeForce drivers); "
             "messages are priced as staged through host memory."),
        ),
    ),
    BuiltinSpec(
        name="h100-8x-nvswitch",
        description="8x H100 SXM5 80GB joined by NVSwitch (NV18 between every pair)",
        topology=_h100_topology,
        device_spec="h100-sxm",
    ),
    BuiltinSpec(
        name="mi300x-8x-xgmi",
        description="8x Instinct MI300X, every pair joined by xGMI (one hive)",
        topology=_mi300x_topology,
        device_spec="mi300x",
    ),
)

COMMON_NOTES = (
    ("built-in profile: derived from a recorded topology dump and the perf models, nothing was timed; "
     "run `tree-attn tune` on the machine for a measured profile."),
)


def _kernel_section(device_key: str | None) -> KernelSection:
    if device_key is None:
        return KernelSection(device_spec=None, buckets=[])
    # Imported here: the perf model needs kernels.shapes, which imports torch.
    from ..cost.devices import KNOWN_DEVICES
    from ..cost.kernel import candidate_configs, rank_candidates
    from ..kernels.shapes import DecodeShape

    spec = KNOWN_DEVICES[device_key]
    buckets = []
    for n in SHARD_LENS:
        shape = DecodeShape(batch=BATCH, q_heads=LLAMA_Q_HEADS, kv_heads=LLAMA_KV_HEADS, head_dim=LLAMA_HEAD_DIM,
                            kv_len=n)
        cands = candidate_configs(shape, LLAMA_DTYPE, spec)
        best = rank_candidates(cands, shape, LLAMA_DTYPE, spec, top_k=1)[0]
        buckets.append(
            KernelBucket(
                dtype=LLAMA_DTYPE,
                head_dim=LLAMA_HEAD_DIM,
                group=LLAMA_Q_HEADS // LLAMA_KV_HEADS,
                max_shard_len=n,
                config=best.config,
                chosen_by="model",
                predicted_us=round(best.predicted_us, 3),
                candidates_tried=len(cands),
            )
        )
    return KernelSection(device_spec=device_key, buckets=buckets)


def _reduction(topo: Topology, use_default: bool) -> Reduction:
    from ..reduce.hier_plan import candidate_plans
    from ..reduce.plan import default_plan

    n = len(topo)
    msg = decode_message_bytes(BATCH, LLAMA_Q_HEADS, LLAMA_HEAD_DIM)
    lse = decode_lse_bytes(BATCH, LLAMA_Q_HEADS)
    plans = candidate_plans(n, topo.hierarchy)
    priced = [(p, round(predict_plan_us(p, topo, msg, lse), 3)) for p in plans]
    if use_default:
        chosen = default_plan(n)
        match = [p for p, _ in priced if p.strategy == "tree" and p.tree(n).parent == chosen.tree(n).parent]
        chosen = match[0] if match else chosen
        chosen_by = "default"
    else:
        # Ties go to the earlier candidate (candidate_plans lists simpler plans first).
        chosen = min(priced, key=lambda pt: pt[1])[0]
        chosen_by = "model"
    cands = [
        PlanCandidate(label=p.label, plan=p, chosen_by="model", predicted_us=t, selected=(p == chosen))
        for p, t in priced
    ]
    if not any(c.selected for c in cands):
        cands.append(PlanCandidate(label=chosen.label, plan=chosen, chosen_by="model",
                                   predicted_us=round(predict_plan_us(chosen, topo, msg, lse), 3), selected=True))
    return Reduction(plan=chosen, chosen_by=chosen_by, message_bytes=msg, candidates=cands)


def build_builtin(spec: BuiltinSpec) -> Profile:
    """The profile ``spec`` describes (deterministic: same code, same dumps, same profile)."""
    topo = spec.topology()
    return Profile(
        name=spec.name,
        created=BUILTIN_CREATED,
        origin="builtin-model",
        description=spec.description,
        # The versions of the models that derived it; torch/triton/driver played no part.
        versions=Versions(tree_attn=_tree_attn_version(), torch=None, triton=None, driver=None),
        machine=Machine.from_topology(topo),
        kernel=_kernel_section(spec.device_spec),
        reduction=_reduction(topo, spec.default_plan),
        notes=list(COMMON_NOTES) + list(spec.notes),
        topology=topo,
    )


def _tree_attn_version() -> str:
    from .. import __version__

    return __version__


def generate() -> dict[str, str]:
    """``{file name: YAML text}`` of every built-in profile."""
    return {f"{s.name}.yaml": profile_to_yaml(build_builtin(s)) for s in BUILTINS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tree_attn.profiles.builtin_gen",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=BUILTIN_DIR,
                        help="folder to write into (default: the package's builtin/)")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if a file differs")
    args = parser.parse_args(argv)
    files = generate()
    stale = []
    for name, text in files.items():
        path = args.out / name
        current = path.read_text(encoding="utf-8") if path.is_file() else None
        if current == text:
            continue
        stale.append(name)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    extra = sorted(p.name for p in args.out.glob("*.yaml") if p.name not in files) if args.out.is_dir() else []
    if args.check:
        for name in stale:
            print(f"{name}: differs from the generator's output", file=sys.stderr)
        for name in extra:
            print(f"{name}: not produced by the generator", file=sys.stderr)
        return 1 if stale or extra else 0
    for name in stale:
        print(f"wrote {args.out.name}/{name}")
    for name in extra:
        print(f"note: {args.out.name}/{name} is not produced by the generator", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
