"""Extra memory of per-layer statistics: must be O(layers), with no copy of the gradient partition.

``tracemalloc`` does not see torch's CPU allocations, and torch keeps no allocator statistics for the
CPU, so memory is read from ``torch.profiler`` (``profile_memory=True``): every allocation and free
through torch's CPU allocator, in time order, matched by address.

- The local statistics path alone (``empty_stats``, ``accumulate_spans``, the all-reduces' buffers,
  ``bucket_results`` before and after clipping) on TinyGPT partitions of 4 to 96 layers and of
  growing hidden size: peak bytes held at once, against the partition's size.
- Whole ``engine.step()`` calls of the 2-rank runs of ``scaling.py``: peak of a measured step against
  an unmeasured one.
"""

import functools
from typing import Callable, Dict, List, Sequence, Tuple

import statistics_before
import torch
from common import machine, mib
from layout import tiny_gpt_partition

from deepspeed_patch.statistics.partition_stats import HOST_PIECE, accumulate_spans
from deepspeed_patch.statistics.statistics import NUM_SUMMED, bucket_results, empty_stats


def peak_allocated(fn: Callable[[], object]) -> Dict[str, int]:
    """Bytes that ``fn`` allocates and holds at once at the worst moment (``peak``), allocates in all
    (``allocated``), and still holds when it returns (``held``).

    Follows each allocation and free that ``torch.profiler`` records (``profile_memory=True``), by
    address; frees of memory allocated before ``fn`` started are ignored.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, pending = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.ptr, event.extra_fields.alloc_size))
    live: Dict[int, int] = {}
    current = peak = allocated = 0
    for _, ptr, size in sorted(events, key=lambda event: event[0]):
        if size > 0:
            live[ptr] = size
            current += size
            allocated += size
        elif ptr in live:
            current -= live.pop(ptr)
        peak = max(peak, current)
    return {"peak": peak, "allocated": allocated, "held": current}


def step_memory(step: Callable[[], object]) -> Dict[str, int]:
    return peak_allocated(step)


def local_path(statistics_fn, runs: Sequence[torch.Tensor], buckets: torch.Tensor, num_buckets: int) -> None:
    """What a measured step allocates for the statistics on one rank, the collective itself aside:
    the table, the per-run work, the all-reduces' buffers and their result, the two result dicts."""
    stats = empty_stats(num_buckets, "cpu")
    statistics_fn(stats, runs, buckets)
    table = torch.cat([stats, torch.zeros((1, stats.shape[1]), dtype=stats.dtype)])  # + the status row
    # reduce_stats' two all-reduce buffers (reduced in place) and the table it returns
    reduced = torch.cat([table[:, :NUM_SUMMED].contiguous(), table[:, NUM_SUMMED:].contiguous()], dim=1)
    keys = list(range(num_buckets))
    bucket_results(reduced[:-1], keys, keys, 1.0)
    bucket_results(reduced[:-1], keys, keys, 0.5)


def synthetic_rows(points: Sequence[Tuple[int, int, str]]) -> List[dict]:
    rows = []
    for num_layers, hidden, sweep in points:
        part = tiny_gpt_partition(num_layers, hidden)
        runs, buckets = part.runs, part.slices.buckets
        after = peak_allocated(functools.partial(local_path, accumulate_spans, runs, buckets, part.num_buckets))
        before = peak_allocated(
            functools.partial(local_path, statistics_before.accumulate_spans, runs, buckets, part.num_buckets))
        rows.append({
            "sweep": sweep,
            "layers": num_layers,
            "hidden": hidden,
            "buckets": part.num_buckets,
            "runs": len(runs),
            "partition_bytes": part.flat.numel() * part.flat.element_size(),
            "after": after,
            "scratch_bytes": min(HOST_PIECE, max(run.numel() for run in runs)) * part.flat.element_size(),
            "before": before
        })
    return rows


def run(quick: bool, rank_rows: Sequence[dict] = ()) -> Tuple[List[str], dict]:
    from scaling import LAYER_COUNTS, PARAMS_HIDDEN, PARAMS_LAYERS, SCALING_HIDDEN

    points = [(layers, SCALING_HIDDEN, "layers") for layers in LAYER_COUNTS]
    points += [(PARAMS_LAYERS, hidden, "params") for hidden in (PARAMS_HIDDEN[:3] if quick else PARAMS_HIDDEN)]
    rows = synthetic_rows(points)
    data = {"machine": machine(), "synthetic": rows, "steps": list(rank_rows)}
    lines = [
        "# Memory of per-layer gradient statistics", "", f"Machine: {data['machine']}.", "",
        "Measured with `torch.profiler` (`profile_memory=True`): every allocation and free through torch's CPU "
        "allocator, in time order, matched by address (tracemalloc does not see torch's CPU allocations, and "
        "torch keeps no CPU allocator statistics).", "", "## The statistics path alone", "",
        "Rank 0's fp32 partition of a TinyGPT on 2 ranks (as in scaling.md). Everything a measured step "
        "allocates for the statistics on one rank, the collective aside: the `(buckets, 9)` float64 table, the "
        "per-run work of `accumulate_spans`, the all-gather's buffers for 2 ranks and their reduction, the "
        "result dicts. Peak = bytes held at once at the worst moment.", "",
        "| layers | hidden | buckets | runs | partition | peak extra now | now / partition | now, beyond the scratch "
        "buffer | peak extra before | before / partition | allocated in all, now / before |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    ]
    for row in rows:
        size = row["partition_bytes"]
        lines.append(f"| {row['layers']} | {row['hidden']} | {row['buckets']} | {row['runs']} | {mib(size)} "
                     f"| **{mib(row['after']['peak'])}** | {row['after']['peak'] / size:.2%} "
                     f"| {mib(row['after']['peak'] - row['scratch_bytes'])} "
                     f"| {mib(row['before']['peak'])} | {row['before']['peak'] / size:.2%} "
                     f"| {mib(row['after']['allocated'])} / {mib(row['before']['allocated'])} |")
    lines += [
        "", "Now: at most one scratch buffer of `HOST_PIECE` elements (2 MiB of fp32; smaller when every run is "
        "smaller) for `|x|`, plus O(buckets + pieces) small tensors (a float64 row of 9 per bucket, per "
        "rank in the all-gather, and 4 scalars per piece of 2 MiB: under 0.001% of the partition). No copy of the "
        "partition: runs are views. Before: `|x|` went into a fresh temporary of up to 4M elements (16 MiB) per "
        "chunk."
    ]
    if rank_rows:
        lines += [
            "", "## Whole optimizer steps", "",
            "The 2-rank runs of scaling.md (TinyGPT hidden 32, `interval: 2`): peak bytes held at once during one "
            "unmeasured and one measured `engine.step()` on rank 0 (after warm-up), and their difference.", "",
            "| ZeRO | layers | buckets | peak, unmeasured step | peak, measured step | extra peak "
            "| extra bytes allocated |", "| --- | --- | --- | --- | --- | --- | --- |"
        ]
        for row in rank_rows:
            plain, measured = row["memory"].get("unmeasured"), row["memory"].get("measured")
            if not plain or not measured:
                continue
            lines.append(f"| {row['zero']} | {row['layers']} | {row['buckets']} | {mib(plain['peak'])} "
                         f"| {mib(measured['peak'])} | **{mib(measured['peak'] - plain['peak'])}** "
                         f"| {mib(measured['allocated'] - plain['allocated'])} |")
    return lines, data
