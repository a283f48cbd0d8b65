"""``results/benchmarks.png`` from the JSON files the benchmark parts write (any part may be missing: git keeps
none of them, so the parts run first)."""

import os
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from common import RESULTS, read_results  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

METHOD_LABELS = {
    "layer_stats": "per-layer stats",
    "full_grad_loop": "safe_get_full_grad loop",
    "backward_hooks": "backward hooks (activation grads)",
    "param_norm_loop": "per-param .norm() loop",
}


def overhead_panel(ax, data: Optional[dict]) -> None:
    ax.set_title("Step-time overhead (median, IQR)")
    if not data:
        ax.axis("off")
        return
    rows = data["rows"]
    width = 0.8 / len(METHOD_LABELS)
    for index, (method, label) in enumerate(METHOD_LABELS.items()):
        medians = [(row["ratios"][method]["median"] - 1) * 100 for row in rows]
        low = [m - (row["ratios"][method]["q1"] - 1) * 100 for m, row in zip(medians, rows)]
        high = [(row["ratios"][method]["q3"] - 1) * 100 - m for m, row in zip(medians, rows)]
        positions = [x + (index - 1.5) * width for x in range(len(rows))]
        ax.bar(positions, medians, width, yerr=[low, high], label=label, capsize=2)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{row['layers']}L h{row['hidden']}\nZeRO-{row['zero']}" for row in rows], fontsize=7)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.axhline(1, color="green", linewidth=0.8, linestyle=":", label="target +1%")
    ax.set_ylabel("% over the unmeasured step")
    ax.legend(fontsize=6)


def stats_panel(ax, data: Optional[dict]) -> None:
    ax.set_title("Statistics alone / one read of the partition")
    if not data:
        ax.axis("off")
        return
    for threads in sorted({point["threads"] for point in data["main"]}):
        points = [point for point in data["main"] if point["threads"] == threads]
        sizes = [point["elements"] / 1e6 for point in points]
        style = "-" if threads == 1 else "--"
        for key, label in (("layer_stats", "now"), ("layer_stats_before", "before"),
                           ("deepspeed_norm", "DeepSpeed norm")):
            ax.plot(sizes, [point["timing"][key]["ratio_median"] for point in points], style, marker="o",
                    label=f"{label}, {threads} thread{'s' if threads > 1 else ''}")
    for point in data.get("passes", []):
        fused = point["timing"].get("fused_compiled")
        if fused:
            ax.plot([point["elements"] / 1e6], [fused["ratio_median"]], "k*", markersize=9)
    ax.plot([], [], "k*", label="fused loop (torch.compile)")
    ax.axhline(1.5, color="green", linestyle=":", label="target 1.5x")
    ax.set_xscale("log")
    ax.set_xlabel("partition elements (M)")
    ax.set_ylabel("x one read")
    ax.legend(fontsize=6)


def passes_panel(ax, data: Optional[dict]) -> None:
    ax.set_title("Each pass alone, largest partition (x one read)")
    if not data or not data.get("passes"):
        ax.axis("off")
        return
    timing = data["passes"][-1]["timing"]
    keys = [key for key in timing if key != "one_read"]
    ax.barh(range(len(keys)), [timing[key]["ratio_median"] for key in keys])
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels(keys, fontsize=6)
    ax.axvline(1.0, color="black", linewidth=0.5)
    ax.axvline(1.5, color="green", linestyle=":")
    ax.set_xscale("log")
    ax.invert_yaxis()


def scaling_panel(ax, data: Optional[dict]) -> None:
    ax.set_title("Statistics alone against the number of layers")
    if not data:
        ax.axis("off")
        return
    points = data["layers"]
    layers = [point["layers"] for point in points]
    ax.plot(layers, [point["timing"]["layer_stats"]["ratio_median"] for point in points], "o-", label="now / read")
    ax.plot(layers, [point["timing"]["layer_stats_before"]["ratio_median"] for point in points], "o--",
            label="before / read")
    ax.set_xlabel(f"layers (hidden {points[0]['hidden']})")
    ax.set_ylabel("x one read")
    twin = ax.twinx()
    twin.plot(layers, [point["timing"]["layer_stats"]["seconds"] * 1e3 for point in points], "s:", color="gray",
              label="now, ms")
    twin.set_ylabel("ms")
    ax.legend(fontsize=6, loc="upper left")
    twin.legend(fontsize=6, loc="upper right")


def collectives_panel(ax, data: Optional[dict]) -> None:
    ax.set_title("Collectives per optimizer step (2 ranks)")
    if not data:
        ax.axis("off")
        return
    from scaling import collective_summary

    for index, zero in enumerate(sorted({row["zero"] for row in data["collectives"]})):
        rows = [row for row in data["collectives"] if row["zero"] == zero]
        layers = [row["layers"] for row in rows]
        summaries = [collective_summary(row)["step"] for row in rows]
        marker, size = ("o", 9) if index == 0 else ("x", 7)  # the stages coincide: big circles, small crosses
        ax.plot(layers, [summary[False][0] for summary in summaries], "--", marker=marker, markersize=size,
                label=f"ZeRO-{zero} unmeasured")
        ax.plot(layers, [summary[True][0] for summary in summaries], "-", marker=marker, markersize=size,
                label=f"ZeRO-{zero} measured")
    ax.set_xlabel("layers")
    ax.set_ylabel("deepspeed.comm calls in engine.step()")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=6)


def memory_panel(ax, data: Optional[dict]) -> None:
    ax.set_title("Peak extra memory of the statistics (one rank)")
    if not data:
        ax.axis("off")
        return
    for sweep, marker in (("layers", "o"), ("params", "s")):
        rows = sorted((row for row in data["synthetic"] if row.get("sweep") == sweep),
                      key=lambda row: row["partition_bytes"])
        if not rows:
            continue
        what = f"hidden {rows[0]['hidden']}, 4-96 layers" if sweep == "layers" else f"{rows[0]['layers']} layers"
        sizes = [row["partition_bytes"] / 2**20 for row in rows]
        ax.plot(sizes, [row["after"]["peak"] / 2**20 for row in rows], marker + "-", label=f"now ({what})")
        ax.plot(sizes, [row["before"]["peak"] / 2**20 for row in rows], marker + "--", label=f"before ({what})")
    sizes = sorted(row["partition_bytes"] / 2**20 for row in data["synthetic"])
    ax.plot(sizes, sizes, ":", color="gray", label="a copy of the partition")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("partition (MiB)")
    ax.set_ylabel("peak extra (MiB)")
    ax.legend(fontsize=6)


def plot(path: str = os.path.join(RESULTS, "benchmarks.png")) -> str:
    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    overhead_panel(axes[0][0], read_results("overhead"))
    stats = read_results("statistics_alone")
    stats_panel(axes[0][1], stats)
    passes_panel(axes[0][2], stats)
    scaling = read_results("scaling")
    scaling_panel(axes[1][0], scaling)
    collectives_panel(axes[1][1], scaling)
    memory_panel(axes[1][2], read_results("memory"))
    machine = next((data["machine"] for data in (stats, scaling) if data), "")
    fig.suptitle(f"Per-layer gradient statistics in DeepSpeed ZeRO-1/2 - {machine}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
