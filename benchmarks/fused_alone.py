"""The fused statistics kernel beside the stock operators, one read and DeepSpeed's norm, in one run.

    python benchmarks/fused_alone.py [--quick] [--device cpu|cuda]

One flat fp32 partition in equal runs, one run per bucket (12 buckets: ``granularity: layer`` of a
12-layer model; 224: per-parameter buckets of a small model; 10,000: ``granularity: param`` of a
large one). Timed in interleaved rounds, each variant ending with its result on the host, as a
measured step needs it:

- one read: ``torch.linalg.vector_norm`` of the partition, the physical limit;
- DeepSpeed's own norm computation: one ``_foreach_norm`` over per-parameter views, summed (16
  parameters a bucket below 224 buckets, else one a bucket);
- stock: ``partition_stats.accumulate_spans``, today's operators (squared norm, ``aminmax``, ``abs`` + ``amin``
  per 2 MiB piece on the host, per 4M-element piece on an accelerator);
- fused: ``partition_stats.accumulate_partition`` with the chunking built at start-up (the host's C++
  kernel, or Triton on CUDA).

On the host the figures are for one thread, then for torch's default, on the shared 2-core machine;
``--device cuda`` writes ``results/gpu/fused_statistics.{md,json}`` (``benchmarks/gpu_check.sh``).
"""

import argparse
import os
from typing import Callable, Dict, List, Sequence, Tuple

import torch
from common import RESULTS, interleaved, machine, ratio_of, times, write_results
from stats_alone import equal_runs

from deepspeed_patch.statistics.kernels import chunk_partition
from deepspeed_patch.statistics.partition_slices import slices_of_spans
from deepspeed_patch.statistics.partition_stats import accumulate_partition, accumulate_spans
from deepspeed_patch.statistics.statistics import NUM_SUMMED, empty_stats

PARAMS_PER_BUCKET = 16
FEW_BUCKETS = 224  # below this many buckets, each bucket holds PARAMS_PER_BUCKET parameters


def variants(flat: torch.Tensor, num_buckets: int) -> Tuple[Dict[str, Callable[[], object]], str]:
    """The four computations over ``flat`` cut into ``num_buckets`` equal runs (checked to agree first),
    and the fused path's kernel."""
    device = flat.device
    runs = equal_runs(flat, num_buckets)
    params = equal_runs(flat, num_buckets * (PARAMS_PER_BUCKET if num_buckets < FEW_BUCKETS else 1))
    offset = flat.storage_offset()
    slices = slices_of_spans([(run.storage_offset() - offset, run.numel(), bucket) for bucket, run in enumerate(runs)],
                            device)
    chunking = chunk_partition(slices, device)
    stock, fused = empty_stats(num_buckets, device), empty_stats(num_buckets, device)
    accumulate_spans(stock, runs, slices.buckets)
    accumulate_partition(fused, flat, chunking)
    assert torch.equal(stock[:, NUM_SUMMED:], fused[:, NUM_SUMMED:]), "fused and stock maxima differ"
    assert torch.allclose(stock, fused, rtol=1e-4), "fused and stock sums differ"
    # The table is ready once the accelerator is done (reading it out costs the same for both paths).
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def stock_stats() -> None:
        accumulate_spans(empty_stats(num_buckets, device), runs, slices.buckets)
        synchronize()

    def fused_stats() -> None:
        accumulate_partition(empty_stats(num_buckets, device), flat, chunking)
        synchronize()

    return {
        "one_read": lambda: torch.linalg.vector_norm(flat).item(),
        "deepspeed_norm": lambda: torch.stack(torch._foreach_norm(params, 2.0)).sum().item(),
        "stock": stock_stats,
        "fused": fused_stats,
    }, chunking.kernel


def settings(device: str, quick: bool) -> Tuple[Sequence[int], Sequence[int], int, Sequence[int]]:
    """Sizes, bucket counts, rounds and thread counts (host) for ``device``."""
    if device == "cuda":
        return (1_000_000, 10_000_000, 100_000_000, 500_000_000), (12, 224, 10_000), 8 if quick else 15, (0, )
    sizes = (1_000_000, 5_000_000, 25_000_000, 50_000_000)
    if quick:
        return (1_000_000, 25_000_000), (12, 10_000), 8, (1, )
    return sizes, (12, 224, 10_000), 15, (1, torch.get_num_threads())


def run(quick: bool, device: str = "cpu") -> Tuple[List[str], dict]:
    sizes, bucket_counts, rounds, thread_counts = settings(device, quick)
    where = torch.cuda.get_device_name() if device == "cuda" else machine()
    data = {"machine": where, "device": device, "rows": []}
    lines = [
        "# The fused statistics kernel beside the stock operators", "", f"Machine: {where}.", "",
        "One flat fp32 partition in equal runs, one run per bucket (12: `granularity: layer` of a 12-layer "
        "model; 224: per-parameter buckets of a small model; 10,000: `granularity: param` of a large one). One "
        "read: `torch.linalg.vector_norm` of the partition. DeepSpeed norm: one `_foreach_norm` over per-parameter "
        f"views, summed ({PARAMS_PER_BUCKET} parameters a bucket below {FEW_BUCKETS} buckets, else one). Stock: "
        "`partition_stats.accumulate_spans` (today's operators). Fused: `partition_stats.accumulate_partition` "
        "with the chunking built at start-up (kernel: `host` C++, `triton`). Every variant ends when its result "
        f"is ready for the host. Median over {rounds} rounds in which every variant runs once in turn; ratios are "
        "per round, with their interquartile range in brackets. Threads: torch's intra-op threads (host only); on "
        "a machine shared with other jobs the rows of more than one thread are erratic (a parallel region waits "
        "for threads that other jobs keep off the cores, for the stock operators as for the fused kernel): read "
        "the one-thread rows.", "",
        "| elements | buckets | threads | kernel | one read | DeepSpeed norm | stock | fused | fused / one read "
        "| stock / one read | fused / DeepSpeed norm | stock / fused |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    default_threads = torch.get_num_threads()
    try:
        for threads in thread_counts:
            if threads:
                torch.set_num_threads(threads)
            for num_elements in sizes:
                flat = torch.randn(num_elements, device=device, generator=torch.Generator(device).manual_seed(0))
                for num_buckets in bucket_counts:
                    fns, kernel = variants(flat, num_buckets)
                    timing = interleaved(fns, rounds, "one_read", warmup=1)
                    data["rows"].append({"elements": num_elements, "buckets": num_buckets, "threads": threads,
                                         "kernel": kernel, "timing": timing})
                    lines.append(row(num_elements, num_buckets, threads, kernel, timing))
                    print(lines[-1], flush=True)
                del flat
    finally:
        torch.set_num_threads(default_threads)
    return lines, data


def row(num_elements: int, num_buckets: int, threads: int, kernel: str, timing: Dict[str, dict]) -> str:
    seconds = {name: result["seconds"] for name, result in timing.items()}
    return (f"| {num_elements / 1e6:.0f}M | {num_buckets} | {threads or '-'} | {kernel} "
            f"| {seconds['one_read'] * 1e3:.2f} ms | {seconds['deepspeed_norm'] * 1e3:.2f} ms "
            f"| {seconds['stock'] * 1e3:.2f} ms | {seconds['fused'] * 1e3:.2f} ms "
            f"| **{times(ratio_of(timing['fused']))}** | {times(ratio_of(timing['stock']))} "
            f"| {seconds['fused'] / seconds['deepspeed_norm']:.2f}x | {seconds['stock'] / seconds['fused']:.1f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", help="folder of fused_statistics.{md,json} (default: results/, results/gpu/ on cuda)")
    args = parser.parse_args()
    folder = args.out or (os.path.join(RESULTS, "gpu") if args.device == "cuda" else RESULTS)
    write_results("fused_statistics", *run(args.quick, args.device), folder=folder)


if __name__ == "__main__":
    main()
