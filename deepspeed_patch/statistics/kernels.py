# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The fused kernels that fold a partition into the statistics table in one read: C++ and OpenMP on the host
(``partition_stats_cpu``), Triton on CUDA and ROCm (``partition_stats_triton``).

A ``Chunking`` is a partition's slices with the chunk list the kernels take and the kernel that reads them,
built once per partition at start-up (``chunk_partition``), when the probe that picks the kernel runs too.
``partition_stats.accumulate_partition`` hands it a partition; where no kernel reads it (the stock path, another
dtype, a partition that is not contiguous), the stock PyTorch operators do, with the same results.
"""

import functools
from dataclasses import dataclass
from typing import Collection, Optional

import torch
from deepspeed.utils import logger

from . import statistics as columns
from .partition_slices import PartitionSlices

HOST, TRITON, STOCK = "host", "triton", "stock"
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Spans are cut into chunks of at most this many elements: a host thread's or a Triton program's unit of
# work (256 KiB of fp32 stays in a core's cache), so long spans spread over all threads and programs.
CHUNK = 1 << 16
EXTRA_BITS = {"l1": 1, "mean": 2, "zeros": 4}  # the statistics of EXTRA_STATISTICS a kernel computes on request


@dataclass(frozen=True)
class Chunking(PartitionSlices):
    """A partition's slices as the kernels read them: cut into chunks (the chunk list), with the kernel that reads
    them."""

    chunks: torch.Tensor
    """The chunk list the kernels take: ``(chunks, 3)`` int64 on the partition's device, the start, length and
    bucket row of each chunk."""
    end: int
    """One past the last element a span covers: the partition must have at least that many."""
    rows: int
    """One more than the largest bucket row: the statistics table must have at least that many."""
    kernel: str
    """``HOST``, ``TRITON`` or ``STOCK``: which path ``accumulate_fused`` takes."""

    def accumulate_fused(self, stats: torch.Tensor, flat: torch.Tensor, extra: Collection[str] = ()) -> bool:
        """Fold the spans in ``flat`` (this rank's 1-D gradient partition) into ``stats`` with the kernel, and
        whether it did: not on the stock path, nor for a partition of another dtype or not contiguous. No host
        synchronisation, no per-span Python. A partition or table too small for the spans is refused first."""
        if flat.dim() != 1 or flat.numel() < self.end or stats.shape[0] < self.rows:
            raise ValueError(f"layer_grad_norms: a partition of {flat.numel()} elements and a table of "
                             f"{stats.shape[0]} buckets do not fit spans up to element {self.end} and bucket "
                             f"row {self.rows - 1}")
        if not flat.device == stats.device == self.chunks.device:
            raise ValueError(f"layer_grad_norms: partition on {flat.device}, statistics on {stats.device}, chunk "
                             f"list on {self.chunks.device}: they must be on one device")
        if self.kernel == STOCK or flat.dtype not in KERNEL_DTYPES or not flat.is_contiguous():
            return False
        bits = sum(EXTRA_BITS[name] for name in extra if name in EXTRA_BITS)
        if self.kernel == HOST:
            from .partition_stats_cpu import host_kernel

            host_kernel()(stats, flat, self.chunks, bits)
        else:
            from .partition_stats_triton import accumulate_chunks

            accumulate_chunks(stats, flat, self.chunks, bits)
        return True


def chunk_partition(slices: PartitionSlices, device, kernel: Optional[str] = None, chunk: int = CHUNK) -> Chunking:
    """The chunking of ``slices`` on ``device`` (where the partition lives).

    ``kernel`` forces a path (tests, benchmarks); by default the best one that ``device`` allows,
    which on the host compiles the C++ kernel now, at start-up, rather than in the first measured step.
    """
    device = torch.device(device)
    buckets = slices.buckets.tolist()
    entries = [(start + offset, min(chunk, length - offset), bucket)
               for start, length, bucket in zip(slices.starts, slices.lengths, buckets)
               for offset in range(0, length, chunk)]
    ends = [start + length for start, length in zip(slices.starts, slices.lengths)]
    return Chunking(starts=slices.starts,
                    lengths=slices.lengths,
                    buckets=slices.buckets,
                    chunks=torch.tensor(entries, dtype=torch.int64).reshape(-1, 3).to(device),
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

        stats = columns.empty_stats(1, device)
        accumulate_chunks(stats, torch.ones(3, device=device), torch.tensor([[0, 3, 0]], device=device), 0)
        if stats[0, columns.NUMEL].item() == 3 and stats[0, columns.SUMSQ].item() == 3:
            return True
        raise RuntimeError(f"wrong result {stats.tolist()}")
    except Exception as error:  # no triton, an unsupported device, a compiler error
        logger.warning(
            "layer_grad_norms: the fused statistics kernel for %s is unavailable (%s: %s); using stock "
            "PyTorch operators instead (slower, same results)", device,
            type(error).__name__, error)
        return False
