"""The plot of `dmt report --plot`: loss, grad norm, tokens/s and memory over the steps of every run, with the
predicted tokens/s and memory drawn in as dashed lines of the run's colour."""

from __future__ import annotations

from pathlib import Path

from toolkit.numeric import GiB
from toolkit.outputs import save_figure
from toolkit.report.breakdown import LABELS
from toolkit.report.runs import RunReport

COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")


def _series(records: list[dict], key: str) -> tuple[list, list]:
    points = [(r["step"], r[key]) for r in records
              if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return [s for s, _ in points], [v for _, v in points]


def predicted_by(breakdown: dict, term: str) -> str:
    """The estimator's terms (those above 0) a measured term's predicted bar sums, largest first: "exposed
    data-parallel communication 0.15 + tensor-parallel communication 0.05"; "" without them."""
    entries = sorted(((entry["predicted_s"], entry["label"]) for entry in (breakdown.get("predicted_terms") or {}).values()
                      if entry["measured_as"] == term and entry["predicted_s"] > 0), reverse=True)
    return " + ".join(f"{label} {seconds:.3g}" for seconds, label in entries)


def _breakdown_bars(ax, reports: list[RunReport]) -> None:
    """Runs with profiled steps: per term, the measured seconds per step (solid) beside the predicted (hatched), run by run."""
    terms = list(LABELS)
    width = 0.8 / (2 * len(reports))
    for index, report in enumerate(reports):
        colour = COLOURS[index % len(COLOURS)]
        measured = [report.breakdown["measured"][term] for term in terms]
        predicted = [(report.breakdown["predicted"] or {}).get(term) or 0.0 for term in terms]
        offset = (2 * index) * width - 0.4 + width / 2
        positions = [i + offset for i in range(len(terms))]
        ax.bar(positions, measured, width, color=colour, label=f"{Path(report.run_dir).name} measured")
        ax.bar([p + width for p in positions], predicted, width, color="white", edgecolor=colour, hatch="//",
               label=f"{Path(report.run_dir).name} predicted")
    # under each term, the estimator's terms its predicted bar sums (the first profiled run's)
    named = [predicted_by(reports[0].breakdown, term).replace(" + ", "\n+ ") for term in terms]
    ax.set_xticks(range(len(terms)), [LABELS[term] + (f"\n({text})" if text else "") for term, text in zip(terms, named)],
                  fontsize=7)
    ax.set_ylabel("seconds per step")
    ax.set_title("where the time went: measured (solid) and predicted (hatched) per term")
    ax.legend(fontsize=8)


def write_report_plot(path: Path, runs: list[tuple[RunReport, list[dict]]]) -> None:
    """One PNG of 4 panels; `runs` are the reports with their metrics.jsonl records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiled = [report for report, _ in runs if report.breakdown is not None]
    fig, axes = plt.subplots(3 if profiled else 2, 2, figsize=(13, 12 if profiled else 8))
    (loss_ax, norm_ax), (speed_ax, memory_ax) = axes[0], axes[1]
    if profiled:
        gs = axes[2, 0].get_gridspec()
        for ax in axes[2]:
            ax.remove()
        _breakdown_bars(fig.add_subplot(gs[2, :]), profiled)
    memory_measured = False
    for index, (report, records) in enumerate(runs):
        colour = COLOURS[index % len(COLOURS)]
        label = f"{Path(report.run_dir).name} ({report.status})"
        loss_ax.plot(*_series(records, "loss"), color=colour, label=label)
        norm_ax.plot(*_series(records, "grad_norm"), color=colour)
        speed_ax.plot(*_series(records, "tokens_per_s"), color=colour, marker=".", linewidth=1)
        if report.predicted["tokens_per_s"]:
            speed_ax.axhline(report.predicted["tokens_per_s"], color=colour, linestyle="--", linewidth=1)
        steps, allocated = _series(records, "gpu_max_allocated_bytes")
        if allocated:
            memory_measured = True
            memory_ax.plot(steps, [v / GiB for v in allocated], color=colour, label="max allocated")
        if report.predicted["allocated_bytes"]:
            memory_ax.axhline(report.predicted["allocated_bytes"] / GiB, color=colour, linestyle="--", linewidth=1,
                              label="predicted (allocator share)")
    loss_ax.set_title("loss")
    norm_ax.set_title("grad norm")
    speed_ax.set_title("tokens/s (dashed: predicted)")
    memory_ax.set_title("GPU memory, GiB per rank (dashed: predicted)")
    if not memory_measured:
        memory_ax.text(0.5, 0.95, "measured: nothing (no CUDA device in these runs)", transform=memory_ax.transAxes,
                       ha="center", va="top", color="grey")
    for ax in (loss_ax, norm_ax, speed_ax, memory_ax):
        ax.set_xlabel("step")
    loss_ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
