"""Pictures: simulated latency and speedup, a measured sequence-length sweep, a topology.

matplotlib is an optional extra (``pip install matplotlib``, or ``pip install ".[plot]"`` in a
checkout), imported inside the functions with the non-interactive Agg backend; without it
:func:`require_matplotlib` raises a ConfigError saying how to install it. Figures are written small
(PNG, 100 dpi) for READMEs.
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError

STRATEGY_COLORS = {"tree": "#1b7837", "allreduce": "#2166ac", "ring": "#b2182b"}
STRATEGY_MARKERS = {"tree": "o", "allreduce": "s", "ring": "^"}  # tree and allreduce bytes overlap
# Link classes, fastest first, as ``topology.model.LinkKind`` names them, and their colours.
LINK_COLORS = {"nvlink": "#1b9e77", "xgmi": "#66a61e", "pix": "#7570b3", "pxb": "#8da0cb", "phb": "#e7298a",
               "node": "#e6ab02", "sys": "#d95f02", "unknown": "#999999", "net": "#a6761d"}
DPI = 100


def require_matplotlib():
    """``matplotlib.pyplot`` on the Agg backend, or a ConfigError naming the install command."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib, an optional extra: pip install matplotlib "
                          '(or, in a checkout of tree-attn, pip install ".[plot]")') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_png_path(path: str) -> None:
    """Refuse a plot path that does not end in .png. Whether it can be written is the rule of every
    output option (``cli.common.check_output``)."""
    if not str(path).lower().endswith(".png"):
        raise ConfigError(f"--plot {path}: the picture is written as PNG; give a file name ending in .png")


def _save(fig, path: str) -> None:
    """Render ``fig`` as PNG and write it atomically (no half-written picture); an OSError is a
    ConfigError naming the path."""
    import io

    import matplotlib.pyplot as plt

    from .files import atomic_write_bytes

    try:
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, dpi=DPI, format="png")
    finally:
        plt.close(fig)
    try:
        atomic_write_bytes(path, buf.getvalue())
    except OSError as exc:
        raise ConfigError(f"cannot write --plot {path}: {exc.strerror or exc}") from None


def _tokens(n: float) -> str:
    if n >= 1_000_000:
        return f"{n / 1_000_000:g}M"
    if n >= 1024:
        return f"{n / 1024:g}K"
    return f"{n:g}"


def plot_simulation(result, path: str) -> None:
    """Left: predicted step time vs sequence length for each strategy (at the largest world size);
    right: ring/tree speedup vs world size, one line per sequence length. ``result`` is a
    ``commands.simulate.SimulateResult``."""
    plt = require_matplotlib()
    rows = result.rows
    worlds = sorted({r.world_size for r in rows})
    seqs = sorted({r.seq_len for r in rows})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    big = worlds[-1]
    for strat in ("tree", "allreduce", "ring"):
        pts = sorted((r.seq_len, r.time_us(strat) / 1e3) for r in rows if r.world_size == big)
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=STRATEGY_COLORS[strat], label=strat, ms=4)
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("sequence length (tokens)")
    ax1.set_ylabel("predicted decode step (ms)")
    nodes, g = next((r.nodes, r.ranks_per_node) for r in rows if r.world_size == big)
    ax1.set_title(f"{result.cluster_name}: {big} GPUs ({nodes}x{g})", fontsize=9)
    ax1.legend(fontsize=8)
    ax1.grid(True, which="both", alpha=0.3)
    for seq in seqs:
        pts = sorted((r.world_size, r.speedup) for r in rows if r.seq_len == seq)
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{_tokens(seq)} tokens", ms=4)
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(worlds, [str(x) for x in worlds])
    ax2.set_yscale("log")
    ax2.set_xlabel("world size (GPUs)")
    ax2.set_ylabel("ring / tree step time")
    ax2.set_title("predicted tree speedup over ring", fontsize=9)
    ax2.legend(fontsize=7)
    ax2.grid(True, which="both", alpha=0.3)
    fig.suptitle("tree-attn simulate (cost model, not a measurement)", fontsize=9)
    _save(fig, path)


def plot_sweep(sweep: list[dict[str, Any]], path: str, title: str) -> None:
    """A measured ``run --sweep``: median step time and bytes sent per rank vs sequence length, one
    line per strategy, log axes. ``sweep`` holds one ``RunResult.to_dict()`` per length."""
    plt = require_matplotlib()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    by: dict[str, list[tuple[int, float, float, float]]] = {}
    for res in sweep:
        n = res["config"]["seq_len"]
        for r in res["results"]:
            by.setdefault(r["strategy"], []).append((n, r["step_ms_median"], r["step_ms_p95"],
                                                     r["bytes_sent_per_step"]))
    for strat, pts in by.items():
        pts.sort()
        xs = [p[0] for p in pts]
        color = STRATEGY_COLORS.get(strat)
        marker = STRATEGY_MARKERS.get(strat, "o") + "-"
        ax1.plot(xs, [p[1] for p in pts], marker, color=color, label=strat, ms=5, mfc="none")
        ax1.fill_between(xs, [p[1] for p in pts], [p[2] for p in pts], color=color, alpha=0.15)
        ax2.plot(xs, [max(p[3], 1) for p in pts], marker, color=color, label=strat, ms=5, mfc="none")
    lengths = sorted({res["config"]["seq_len"] for res in sweep})
    for ax, ylabel in ((ax1, "median step (ms; band to p95)"), (ax2, "bytes sent per rank per step")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [_tokens(n) for n in lengths])
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    _save(fig, path)


def plot_topology(topo, path: str) -> None:
    """The fabric as a picture: devices on a circle, grouped by island (the finest level of the
    hierarchy with more than one group), every pair's link coloured by its class, slower classes
    drawn first and thinner."""
    import math

    plt = require_matplotlib()
    n = len(topo)
    levels = topo.hierarchy
    islands = next((lvl.groups for lvl in levels if 1 < len(lvl.groups) < n), None) or [list(range(n))]
    order = [d for grp in islands for d in grp]
    # Islands as arcs of the circle, with a gap between them.
    gap = 0.6 if len(islands) > 1 else 0.0
    slots = n + gap * len(islands)
    pos, s = {}, 0.0
    for grp in islands:
        for d in grp:
            ang = 2 * math.pi * s / slots
            pos[d] = (math.cos(ang), math.sin(ang))
            s += 1
        s += gap
    fig, ax = plt.subplots(figsize=(5.2, 5.2))
    kinds_present = sorted({l.kind for l in topo.links}, key=lambda k: k.rank, reverse=True)
    for kind in kinds_present:  # slowest first, so the fast links are drawn on top
        width = 0.6 + 2.4 * (1 - kind.rank / 8)
        for l in topo.links:
            if l.kind is kind:
                (xa, ya), (xb, yb) = pos[l.a], pos[l.b]
                ax.plot([xa, xb], [ya, yb], color=LINK_COLORS.get(kind.value, "#333333"), lw=width, alpha=0.8,
                        zorder=1)
        ax.plot([], [], color=LINK_COLORS.get(kind.value, "#333333"), lw=width, label=kind.value)
    for i, grp in enumerate(islands if len(islands) > 1 else []):
        # An island: a grey band outside the circle, from its first member's angle to its last.
        a0 = math.atan2(pos[grp[0]][1], pos[grp[0]][0])
        a1 = math.atan2(pos[grp[-1]][1], pos[grp[-1]][0])
        if a1 < a0:
            a1 += 2 * math.pi
        pad = 0.12
        angs = [a0 - pad + (a1 - a0 + 2 * pad) * t / 40 for t in range(41)]
        ax.plot([1.2 * math.cos(a) for a in angs], [1.2 * math.sin(a) for a in angs], color="#888888", lw=6,
                alpha=0.45, solid_capstyle="round", zorder=0)
        mid = (a0 + a1) / 2
        ax.text(1.36 * math.cos(mid), 1.36 * math.sin(mid), f"island {i}", ha="center", va="center", fontsize=7,
                color="#555555")
    for d in order:
        x, y = pos[d]
        ax.scatter([x], [y], s=420, color="white", edgecolors="black", zorder=2)
        ax.text(x, y, str(d), ha="center", va="center", fontsize=9, zorder=3)
    from .profiles.schema import hierarchy_text

    name = topo.devices[0].name if topo.devices[0].name != "unknown" else "devices"
    levels_text = " > ".join(hierarchy_text(topo))
    if len(levels_text) > 70:
        levels_text = levels_text[:67] + "..."
    ax.set_title(f"{n} x {name} ({topo.source})\nhierarchy: {levels_text}", fontsize=8)
    ax.legend(title="link class", fontsize=7, title_fontsize=7, loc="upper right", bbox_to_anchor=(1.12, 1.0))
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_xlim(-1.5, 1.5)
    ax.set_ylim(-1.5, 1.5)
    _save(fig, path)
