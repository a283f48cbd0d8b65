# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Per-bucket statistics of a flat gradient partition in one read, by a fused kernel.

``run_table`` turns a group's ``PartitionSlices`` into a chunk table once, at start-up, and picks the
kernel that will read the partition: the host kernel (C++ and OpenMP, ``partition_stats_cpu``) for a
partition in host memory, the Triton kernel (``partition_stats_triton``) for one on a CUDA or ROCm
device, or the stock operators of ``statistics.accumulate_runs`` where neither is available.
``accumulate_partition`` then folds the partition into the ``(buckets, 9)`` table each measured step,
with the same results as ``accumulate_runs``: min, max, abs-min and the counts bit for bit (NaN where
it has NaN), the sums to float64 rounding (they are accumulated in float64, where ``accumulate_runs``
takes the squared norm and L1 in the gradient's precision).
"""

import functools
from dataclasses import dataclass
from typing import Collection, Optional

import torch
from deepspeed.utils import logger

from .partition_slices import PartitionSlices
from .statistics import NUMEL, SUMSQ, accumulate_runs, empty_stats

HOST, TRITON, STOCK = "host", "triton", "stock"
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Runs are cut into chunks of at most this many elements: a host thread's or a Triton program's unit of
# work (256 KiB of fp32 stays in a core's cache), so long runs spread over all threads and programs.
CHUNK = 1 << 16
EXTRA_BITS = {"l1": 1, "mean": 2, "zeros": 4}  # the statistics of EXTRA_STATISTICS a kernel computes on request


@dataclass(frozen=True)
class RunTable:
    """One group's partition runs as the fused kernels read them; built once, next to its slices."""

    slices: PartitionSlices
    chunks: torch.Tensor
    """``(chunks, 3)`` int64 on the partition's device: start, length and bucket row of each chunk."""
    end: int
    """One past the last element a run covers: the partition must have at least that many."""
    rows: int
    """One more than the largest bucket row: the statistics table must have at least that many."""
    kernel: str
    """``HOST``, ``TRITON`` or ``STOCK``: which path ``accumulate_partition`` takes."""


def run_table(slices: PartitionSlices, device, kernel: Optional[str] = None, chunk: int = CHUNK) -> RunTable:
    """The chunk table of ``slices`` on ``device`` (where the partition lives).

    ``kernel`` forces a path (tests, benchmarks); by default the best one that ``device`` allows,
    which on the host compiles the C++ kernel now, at start-up, rather than in the first measured step.
    """
    device = torch.device(device)
    buckets = slices.buckets.tolist()
    entries = [(start + offset, min(chunk, length - offset), bucket)
               for start, length, bucket in zip(slices.starts, slices.lengths, buckets)
               for offset in range(0, length, chunk)]
    chunks = torch.tensor(entries, dtype=torch.int64).reshape(-1, 3).to(device)
    ends = [start + length for start, length in zip(slices.starts, slices.lengths)]
    return RunTable(slices=slices,
                    chunks=chunks,
                    end=max(ends, default=0),
                    rows=max(buckets, default=-1) + 1,
                    kernel=kernel or _best_kernel(device))


def _best_kernel(device: torch.device) -> str:
    if device.type == "cpu":
        from .partition_stats_cpu import host_kernel

        return HOST if host_kernel() is not None else STOCK
    if device.type == "cuda" and _triton_runs(device):
        return TRITON
    return STOCK


@functools.lru_cache(maxsize=None)
def _triton_runs(device: torch.device) -> bool:
    """Whether the Triton kernel compiles and runs on ``device``: tried once per process, at start-up, on
    three elements, so that a missing or unusable Triton falls back to the stock operators (with one
    warning) instead of failing the first measured step."""
    try:
        from .partition_stats_triton import accumulate_chunks

        stats = empty_stats(1, device)
        accumulate_chunks(stats, torch.ones(3, device=device), torch.tensor([[0, 3, 0]], device=device), 0)
        if stats[0, NUMEL].item() == 3 and stats[0, SUMSQ].item() == 3:
            return True
        raise RuntimeError(f"wrong result {stats.tolist()}")
    except Exception as error:  # no triton, an unsupported device, a compiler error
        logger.warning(
            "layer_grad_norms: the fused statistics kernel for %s is unavailable (%s: %s); using stock "
            "PyTorch operators instead (slower, same results)", device,
            type(error).__name__, error)
        return False


def accumulate_partition(stats: torch.Tensor, flat: torch.Tensor, table: RunTable,
                         extra: Collection[str] = ()) -> None:
    """Fold the runs of ``table`` in ``flat`` (this rank's 1-D gradient partition) into ``stats``.

    ``extra`` names the statistics of ``EXTRA_STATISTICS`` to compute as well. No host
    synchronisation, no per-run Python; only the stock path keeps ``accumulate_runs``' own (on an
    accelerator, its non-finite check and small host-to-device copies). A partition of another dtype,
    or not contiguous, takes the stock path.
    """
    if flat.dim() != 1 or flat.numel() < table.end or stats.shape[0] < table.rows:
        raise ValueError(f"layer_grad_norms: a partition of {flat.numel()} elements and a table of "
                         f"{stats.shape[0]} buckets do not fit runs up to element {table.end} and bucket "
                         f"row {table.rows - 1}")
    if not flat.device == stats.device == table.chunks.device:
        raise ValueError(f"layer_grad_norms: partition on {flat.device}, statistics on {stats.device}, run "
                         f"table on {table.chunks.device}: they must be on one device")
    if table.kernel == STOCK or flat.dtype not in KERNEL_DTYPES or not flat.is_contiguous():
        accumulate_runs(stats, table.slices.views(flat), table.slices.buckets, extra)
        return
    bits = sum(EXTRA_BITS[name] for name in extra if name in EXTRA_BITS)
    if table.kernel == HOST:
        from .partition_stats_cpu import host_kernel

        host_kernel()(stats, flat, table.chunks, bits)
    else:
        from .partition_stats_triton import accumulate_chunks

        accumulate_chunks(stats, flat, table.chunks, bits)
