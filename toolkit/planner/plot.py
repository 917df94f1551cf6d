"""The memory plot of `dmt plan --plot`: stacked per-GPU bytes of the top plans and of ZeRO 0-3, with the GPU line."""

from __future__ import annotations

from pathlib import Path

from toolkit.estimate.memory import MemoryBreakdown
from toolkit.outputs import save_figure
from toolkit.planner.predict import plan_label
from toolkit.spec.cluster import GPU
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import Plan

COMPONENTS = ("weights", "gradients", "optimizer", "activations", "overhead")
COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8C8C8C")


def write_memory_plot(
    path: Path,
    model: ModelSpec,
    gpu: GPU,
    top: list[tuple[Plan, MemoryBreakdown]],
    zero_stages: list[tuple[Plan, MemoryBreakdown]],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"#{i} " + plan_label(p), m) for i, (p, m) in enumerate(top, 1)]
    bars += [(f"ZeRO-{p.zero} dp{p.dp} mb{p.micro_batch} rc=full", m) for p, m in zero_stages]
    gib = 1024**3
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(bars)), 6))
    bottoms = [0.0] * len(bars)
    for component, colour in zip(COMPONENTS, COLOURS):
        heights = [getattr(m, component) / gib for _, m in bars]
        ax.bar(range(len(bars)), heights, bottom=bottoms, color=colour, label=component)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    capacity = gpu.memory_bytes / gib
    ax.axhline(capacity, color="black", linestyle="--", linewidth=1)
    ax.text(len(bars) - 0.5, capacity, f" {gpu.name} {capacity:.0f} GiB", va="bottom", ha="right")
    if top:
        ax.axvline(len(top) - 0.5, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([label for label, _ in bars], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"{model.name}: per-GPU memory of the fastest plans (left) and of ZeRO 0-3 (right)")
    top_height = max((m.total / gib for _, m in bars[: len(top)]), default=0)
    ceiling = max(capacity * 1.6, top_height * 1.1)
    ax.set_ylim(0, ceiling)
    for x, total in enumerate(bottoms):  # bars that leave the frame say how tall they are
        if total > ceiling:
            ax.text(x, ceiling * 0.97, f"{total:.0f} GiB \u2191", ha="center", va="top", fontsize=8, color="white",
                    bbox=dict(facecolor="black", alpha=0.6, pad=2))
    ax.legend(loc="upper left")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
