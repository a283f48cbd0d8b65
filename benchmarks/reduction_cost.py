"""What the step's reduction costs: an alpha-beta model to 16,384 ranks, checked against gloo at 2 to 8.

A measured step reduces one ``(buckets + 1, 9)`` float64 table per rank (the status row included):
``T = (buckets + 1) * 72`` bytes. Before: one all-gather of every rank's table, combined locally
(``old``). Now: one SUM all-reduce of the 6 summed columns and one MAX all-reduce of the other 3
(``new``, ``deepspeed_patch.statistics.reduction``). Per rank and measured step, with ``W`` ranks:

| | latency | bytes received |
| --- | --- | --- |
| old, ring all-gather | ``base + (W-1) hop`` | ``(W-1) T`` |
| old, tree (recursive doubling) all-gather | ``base + log2(W) hop`` | ``(W-1) T`` |
| new, 2 ring all-reduces | ``2 (base + 2 (W-1) hop)`` | ``2 (W-1)/W T`` |
| new, 2 tree all-reduces (reduce, then broadcast) | ``2 (base + 2 log2(W) hop)`` | ``2 T`` |

time = latency + bytes / bandwidth. NCCL has no tree all-gather (ring only); the tree row stands for
the best a latency-bound all-gather could do.

Constants (``LINKS``): per-collective ``base`` and per-step ``hop`` latencies are NCCL's own tuning
model for the LL protocol, which NCCL picks for messages this small (``src/graph/tuning.cc``,
``baseLat`` Tree 4.4 us / Ring 3.6 us; ``hwLat`` NVLink Tree 0.5 / Ring 0.4 us, network Tree 5.0 /
Ring 0.9 us, NCCL 2.8). Bandwidth per GPU: InfiniBand NDR, 400 Gb/s = 50 GB/s (one NIC per GPU as in
a DGX H100); NVLink 4, 450 GB/s per direction (NVIDIA H100 SXM datasheet, 900 GB/s bidirectional).
Both are link rates: NCCL's LL protocol carries half of that, so small tables run slower than the
bandwidth term says, by at most 2x of a term that is small there anyway.

``python benchmarks/reduction_cost.py`` writes ``results/reduction_cost.{md,json,png}``: the model's
table and plot, and gloo measurements on this machine at 2, 4 and 8 ranks (one launch each, both
reductions alternating, the bytes handed to the collectives counted), with the model's alpha and beta
fitted to them (``--no-measure``: the model alone).
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

from common import RESULTS, machine  # noqa: E402

WORLD_SIZES = (2, 8, 64, 384, 1024, 4096, 16384)
BUCKETS = (16, 130, 1000, 10000)
MEASURED_WORLDS = (2, 4, 8)
BYTES_PER_ROW = 9 * 8
SUMMED_COLUMNS = 6
# link: (base latency per collective, tree, ring; per-step latency, tree, ring; bandwidth), seconds and bytes/s
LINKS = {
    "InfiniBand NDR": {
        "base": {
            "tree": 4.4e-6,
            "ring": 3.6e-6
        },
        "hop": {
            "tree": 5.0e-6,
            "ring": 0.9e-6
        },
        "bandwidth": 50e9
    },
    "NVLink 4": {
        "base": {
            "tree": 4.4e-6,
            "ring": 3.6e-6
        },
        "hop": {
            "tree": 0.5e-6,
            "ring": 0.4e-6
        },
        "bandwidth": 450e9
    },
}


def table_bytes(buckets: int) -> int:
    """One rank's table, the status row included."""
    return (buckets + 1) * BYTES_PER_ROW


def steps(world: int, algorithm: str) -> int:
    """Latency steps of one pass: ``W - 1`` around a ring, ``log2(W)`` up or down a tree."""
    return world - 1 if algorithm == "ring" else math.ceil(math.log2(world))


def received_bytes(world: int, buckets: int, reduction: str, algorithm: str) -> float:
    """Bytes that reach one rank per measured step."""
    size = table_bytes(buckets)
    if reduction == "old":
        return (world - 1) * size
    return 2 * (world - 1) / world * size if algorithm == "ring" else 2 * size


def modelled_seconds(world: int, buckets: int, reduction: str, algorithm: str, link: Dict) -> float:
    """Latency plus bytes over bandwidth, per rank and measured step."""
    base, hop = link["base"][algorithm], link["hop"][algorithm]
    if reduction == "old":
        latency = base + steps(world, algorithm) * hop
    else:
        latency = 2 * (base + 2 * steps(world, algorithm) * hop)
    return latency + received_bytes(world, buckets, reduction, algorithm) / link["bandwidth"]


def model_rows() -> List[Dict]:
    rows = []
    for buckets in BUCKETS:
        for world in WORLD_SIZES:
            row = {"buckets": buckets, "world": world}
            for reduction in ("old", "new"):
                row[f"{reduction}_bytes_ring"] = received_bytes(world, buckets, reduction, "ring")
                row[f"{reduction}_bytes_tree"] = received_bytes(world, buckets, reduction, "tree")
                for name, link in LINKS.items():
                    for algorithm in ("ring", "tree"):
                        row[f"{reduction}_{algorithm}_{name}"] = modelled_seconds(world, buckets, reduction, algorithm,
                                                                                  link)
            rows.append(row)
    return rows


def measure_rank(buckets_list: Tuple[int, ...], repeats: int) -> Dict:
    """On each rank: seconds per reduction, old and new alternating, and the bytes each hands to its
    collectives (the tensors passed in, and the buffers filled)."""
    import torch
    from deepspeed import comm as dist

    from deepspeed_patch.statistics import reduction
    from deepspeed_patch.statistics.statistics import NUM_SUMMED

    def old(stats: torch.Tensor) -> torch.Tensor:
        gathered = [torch.empty_like(stats) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, stats)
        stacked = torch.stack(gathered)
        return torch.cat([stacked[:, :, :NUM_SUMMED].sum(0), stacked[:, :, NUM_SUMMED:].amax(0)], dim=1)

    counted = {"bytes": 0}
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def counting(name):

        def wrapper(tensor_or_list, *args, **kwargs):
            tensors = [tensor_or_list, *args[:1]] if name == "all_reduce" else [*tensor_or_list, *args[:1]]
            counted["bytes"] += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            return originals[name](tensor_or_list, *args, **kwargs)

        return wrapper

    results = {}
    for buckets in buckets_list:
        table = torch.randn(buckets + 1, 9, dtype=torch.float64)
        seconds = {"old": [], "new": []}
        handed = {}
        for repeat in range(repeats + 3):
            for name, fn in (("old", old), ("new", reduction.reduce_stats)):
                for op in originals:
                    setattr(dist, op, counting(op))
                counted["bytes"] = 0
                dist.barrier()
                start = time.perf_counter()
                fn(table)
                elapsed = time.perf_counter() - start
                for op, original in originals.items():
                    setattr(dist, op, original)
                handed[name] = counted["bytes"]
                if repeat >= 3:  # warm-up
                    seconds[name].append(elapsed)
        results[buckets] = {name: statistics.median(values) for name, values in seconds.items()}
        results[buckets]["bytes"] = handed
    return results


def measure(repeats: int) -> Dict[int, Dict]:
    from megatron_integration.cpu_launch import launch

    measured = {}
    for world in MEASURED_WORLDS:
        by_rank = launch(measure_rank, world, BUCKETS, repeats)
        measured[world] = {
            buckets: {
                "old": max(rank[buckets]["old"] for rank in by_rank),
                "new": max(rank[buckets]["new"] for rank in by_rank),
                "bytes": by_rank[0][buckets]["bytes"],
                "bytes_same_on_every_rank": len({repr(rank[buckets]["bytes"])
                                                 for rank in by_rank}) == 1,
            }
            for buckets in BUCKETS
        }
    return measured


def fit_gloo(measured: Dict[int, Dict]) -> Tuple[float, float]:
    """Per-step latency and bandwidth of gloo here, least squares over both reductions' ring formulas
    (gloo's all-gather and all-reduce are rings)."""
    samples = []
    for world, by_buckets in measured.items():
        for buckets, times in by_buckets.items():
            size = table_bytes(buckets)
            samples.append(((world - 1), (world - 1) * size, times["old"]))
            samples.append((4 * (world - 1), 2 * (world - 1) / world * size, times["new"]))
    # Normal equations of t = hop * a + b / bandwidth.
    saa = sum(a * a for a, _, _ in samples)
    sab = sum(a * b for a, b, _ in samples)
    sbb = sum(b * b for _, b, _ in samples)
    sat = sum(a * t for a, _, t in samples)
    sbt = sum(b * t for _, b, t in samples)
    det = saa * sbb - sab * sab
    hop, inverse_bandwidth = (sbb * sat - sab * sbt) / det, (saa * sbt - sab * sat) / det
    return hop, 1.0 / inverse_bandwidth


def gloo_predicted(world: int, buckets: int, reduction: str, hop: float, bandwidth: float) -> float:
    link = {"base": {"ring": 0.0}, "hop": {"ring": hop}, "bandwidth": bandwidth}
    return modelled_seconds(world, buckets, reduction, "ring", link)


def human_bytes(value: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def microseconds(value: float) -> str:
    return f"{value * 1e6:,.0f} us" if value >= 1e-4 else f"{value * 1e6:.1f} us"


def model_markdown(rows: List[Dict]) -> List[str]:
    lines = [
        "| buckets | ranks | bytes in, old (all-gather) | bytes in, new (ring / tree) | "
        "IB ring: old -> new | IB tree: old -> new | NVLink ring: old -> new |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    ]
    for row in rows:
        pairs = [
            f"{microseconds(row[f'old_{column}'])} -> {microseconds(row[f'new_{column}'])}"
            for column in ("ring_InfiniBand NDR", "tree_InfiniBand NDR", "ring_NVLink 4")
        ]
        lines.append(f"| {row['buckets']:,} | {row['world']:,} | {human_bytes(row['old_bytes_ring'])} | "
                     f"{human_bytes(row['new_bytes_ring'])} / {human_bytes(row['new_bytes_tree'])} | " +
                     " | ".join(pairs) + " |")
    return lines


def measured_markdown(measured: Dict[int, Dict], hop: float, bandwidth: float) -> List[str]:
    lines = [
        f"gloo fitted to these: {hop * 1e6:.1f} us per ring step, {bandwidth / 1e9:.2f} GB/s.", "",
        "| ranks | buckets | old, measured (model) | new, measured (model) | old / new, measured (model) | "
        "bytes handed to the collectives per rank: old / new |", "| ---: | ---: | ---: | ---: | ---: | ---: |"
    ]
    for world, by_buckets in measured.items():
        for buckets, times in by_buckets.items():
            old_model = gloo_predicted(world, buckets, "old", hop, bandwidth)
            new_model = gloo_predicted(world, buckets, "new", hop, bandwidth)
            lines.append(f"| {world} | {buckets:,} | {microseconds(times['old'])} ({microseconds(old_model)}) | "
                         f"{microseconds(times['new'])} ({microseconds(new_model)}) | "
                         f"{times['old'] / times['new']:.2f} ({old_model / new_model:.2f}) | "
                         f"{human_bytes(times['bytes']['old'])} / {human_bytes(times['bytes']['new'])} |")
    return lines


def plot(rows: List[Dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for buckets, style in ((130, "-"), (10000, "--")):
        chosen = [row for row in rows if row["buckets"] == buckets]
        worlds = [row["world"] for row in chosen]
        for reduction, colour in (("old", "tab:red"), ("new", "tab:blue")):
            label = f"{'all-gather' if reduction == 'old' else '2 all-reduces'}, {buckets:,} buckets"
            axes[0].plot(worlds, [row[f"{reduction}_bytes_ring"] for row in chosen], style, color=colour, label=label)
            best = [
                min(row[f"{reduction}_ring_InfiniBand NDR"], row[f"{reduction}_tree_InfiniBand NDR"]) for row in chosen
            ]
            axes[1].plot(worlds, [seconds * 1e6 for seconds in best], style, color=colour, label=label)
    axes[0].set_ylabel("bytes received per rank per measured step")
    axes[1].set_ylabel("modelled time per measured step (us), InfiniBand, best of ring and tree")
    for axis in axes:
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("ranks")
        axis.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle("Reducing the per-layer statistics: all-gather (before) against SUM + MAX all-reduce (now)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-measure", action="store_true", help="the model alone, no gloo launches")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    rows = model_rows()
    lines = [
        "# The step's reduction: all-gather (before) against SUM + MAX all-reduce (now)", "",
        "Model: `benchmarks/reduction_cost.py` (alpha-beta; NCCL 2.8's LL-protocol latencies from its "
        "`src/graph/tuning.cc`, InfiniBand NDR 50 GB/s and NVLink 4 450 GB/s per GPU), per rank and "
        "measured step; a table of `buckets + 1` rows of 72 bytes.", ""
    ] + model_markdown(rows)
    result = {"model": rows}
    if not args.no_measure:
        measured = measure(args.repeats)
        hop, bandwidth = fit_gloo(measured)
        result.update(measured=measured, gloo_hop_seconds=hop, gloo_bandwidth=bandwidth, machine=machine())
        lines += [
            "", f"## gloo on this machine ({machine()})", "",
            f"Median of {args.repeats} of each, alternating, slowest rank; 8 ranks on 2 shared cores are "
            "oversubscribed, so the times there are the scheduler's as much as gloo's."
        ] + [""]
        lines += measured_markdown(measured, hop, bandwidth)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "reduction_cost.md"), "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
    with open(os.path.join(RESULTS, "reduction_cost.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1, default=str)
    plot(rows, os.path.join(RESULTS, "reduction_cost.png"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
