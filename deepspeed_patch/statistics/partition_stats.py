# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The kernels that fold a gradient partition's spans into the statistics table (``statistics``).

In one read by a fused kernel where one is available (C++ and OpenMP on the host, ``partition_stats_cpu``;
Triton on CUDA and ROCm, ``partition_stats_triton``), else with stock PyTorch operators over the spans
(``accumulate_spans``), with the same results. A ``Chunking``, built once per parameter group at start-up,
says where each run lies and which kernel reads it; the probe that picks the kernel runs then too. The
extra statistics (L1, sum, zeros) are computed only when asked for.
"""

import functools
from dataclasses import dataclass
from typing import Collection, List, Optional, Sequence, Tuple

import torch
from deepspeed.utils import logger

from . import statistics as columns
from .partition_slices import PartitionSlices

# Spans are read piece by piece, each piece three times in a row (squared norm, min and max, |x| into a
# scratch buffer for abs_min). On the host a piece of 2 MiB of fp32 stays in the CPU's cache between those
# reads, so the partition comes from memory about once; elsewhere pieces only bound the scratch buffer.
HOST_PIECE = 1 << 19
DEVICE_PIECE = 1 << 22


def accumulate_spans(stats: torch.Tensor,
                     spans: Sequence[torch.Tensor],
                     buckets: torch.Tensor,
                     extra: Collection[str] = (),
                     piece: Optional[int] = None) -> None:
    """Fold the statistics of ``spans`` (1-D gradient slices) into their ``buckets`` rows of ``stats``.

    ``extra`` names the statistics of ``EXTRA_STATISTICS`` to compute as well; ``piece`` overrides the
    number of elements read at a time (``HOST_PIECE`` or ``DEVICE_PIECE``). Spans of any floating dtype
    are read; fp16 and bf16 pieces are converted one at a time into a scratch buffer, never as a whole.
    One host synchronisation per call: non-finite elements are counted only when a span's min or max says
    there are some, which keeps the common case to three reductions over the gradient.
    """
    if not spans:
        return
    piece = piece or (HOST_PIECE if spans[0].device.type == "cpu" else DEVICE_PIECE)
    pieces: List[torch.Tensor] = []
    owners: List[int] = []
    for index, span in enumerate(spans):
        split = span.split(piece)
        pieces.extend(split)
        owners.extend([index] * len(split))
    scratch = torch.empty(max(piece.numel() for piece in pieces), dtype=torch.float32, device=pieces[0].device)
    sumsq, lows, highs, abs_mins = _piece_statistics(pieces, scratch)
    per_piece = torch.zeros((len(pieces), columns.NUM_COLUMNS), dtype=torch.float64, device=stats.device)
    per_piece[:, columns.SUMSQ] = sumsq
    min_max = torch.stack([lows, highs], dim=1).double()
    per_piece[:, columns.MAX], per_piece[:, columns.NEG_MIN] = min_max[:, 1], -min_max[:, 0]
    per_piece[:, columns.NEG_ABS_MIN] = -abs_mins.double()
    per_piece[:, columns.NUMEL] = torch.tensor([piece.numel() for piece in pieces], dtype=torch.float64)
    if "l1" in extra:
        per_piece[:, columns.L1] = torch.stack([torch.linalg.vector_norm(p, 1, dtype=torch.float64) for p in pieces])
    if "mean" in extra:
        per_piece[:, columns.SUM] = torch.stack([piece.sum(dtype=torch.float64) for piece in pieces])
    if "zeros" in extra:
        per_piece[:,
                  columns.ZEROS] = per_piece[:, columns.NUMEL] - torch.stack([torch.count_nonzero(p)
                                                                              for p in pieces]).double()
    finite = torch.isfinite(min_max).all(dim=1)
    if not bool(finite.all()):  # a NaN or an infinity makes its piece's min or max non-finite
        for index in torch.nonzero(~finite).flatten().tolist():
            per_piece[index, columns.NONFINITE] = _count_nonfinite(pieces[index], scratch)
    piece_buckets = buckets if len(pieces) == len(spans) else buckets[torch.tensor(owners, device=buckets.device)]
    index = piece_buckets.unsqueeze(1).expand(-1, columns.NUM_SUMMED)
    stats[:, :columns.NUM_SUMMED].scatter_add_(0, index, per_piece[:, :columns.NUM_SUMMED])
    index = piece_buckets.unsqueeze(1).expand(-1, columns.NUM_COLUMNS - columns.NUM_SUMMED)
    stats[:, columns.NUM_SUMMED:].scatter_reduce_(0, index, per_piece[:, columns.NUM_SUMMED:], reduce="amax")


def _piece_statistics(pieces: List[torch.Tensor], scratch: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Squared L2 norm, min, max and min of |x| of each piece, as four 1-D tensors.

    Each piece is read while it is in cache: its squared norm as a dot product, then min and max, then
    |x| written into the fp32 ``scratch`` buffer (``torch.linalg.vector_norm(x, -inf)`` would need
    none, but is ~15x slower on CPU). An fp16 or bf16 piece is first converted into that buffer, so the
    three reductions run on fp32 values (exact for min and max) and |x| is taken in place.
    """
    squares, lows, highs, abs_mins = [], [], [], []
    for piece in pieces:
        if piece.dtype in (torch.float32, torch.float64):
            values, magnitude = piece, scratch[:piece.numel()] if piece.dtype == torch.float32 else None
        else:
            values = magnitude = scratch[:piece.numel()].copy_(piece)  # our own copy: |x| in place
        squares.append(torch.dot(values, values))  # accumulates in the values' type, per piece
        low, high = torch.aminmax(values)
        lows.append(low)
        highs.append(high)
        abs_mins.append(torch.abs(values, out=magnitude).amin())
    return torch.stack(squares).double(), torch.stack(lows), torch.stack(highs), torch.stack(abs_mins)


def _count_nonfinite(piece: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """The NaN and infinite elements of a piece, counted in the scratch buffer: no allocation."""
    if piece.dtype == torch.float64:  # too wide for the fp32 buffer; a rare dtype for gradients
        return torch.count_nonzero(~torch.isfinite(piece))
    values = scratch[:piece.numel()].copy_(piece)
    return values.mul_(0.0).nan_to_num_(nan=1.0).sum()  # x * 0 is 0 for a finite x, NaN otherwise


HOST, TRITON, STOCK = "host", "triton", "stock"
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Spans are cut into chunks of at most this many elements: a host thread's or a Triton program's unit of
# work (256 KiB of fp32 stays in a core's cache), so long spans spread over all threads and programs.
CHUNK = 1 << 16
EXTRA_BITS = {"l1": 1, "mean": 2, "zeros": 4}  # the statistics of EXTRA_STATISTICS a kernel computes on request


@dataclass(frozen=True)
class Chunking:
    """How the kernels read one parameter group's partition: its spans cut into chunks (the chunk list), and the
    kernel that reads them; built once, next to its slices."""

    slices: PartitionSlices
    chunks: torch.Tensor
    """The chunk list the kernels take: ``(chunks, 3)`` int64 on the partition's device, the start, length and
    bucket row of each chunk."""
    end: int
    """One past the last element a span covers: the partition must have at least that many."""
    rows: int
    """One more than the largest bucket row: the statistics table must have at least that many."""
    kernel: str
    """``HOST``, ``TRITON`` or ``STOCK``: which path ``accumulate_partition`` takes."""


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
    chunks = torch.tensor(entries, dtype=torch.int64).reshape(-1, 3).to(device)
    ends = [start + length for start, length in zip(slices.starts, slices.lengths)]
    return Chunking(slices=slices,
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


def accumulate_partition(stats: torch.Tensor, flat: torch.Tensor, chunking: Chunking,
                         extra: Collection[str] = ()) -> None:
    """Fold the spans of ``chunking`` in ``flat`` (this rank's 1-D gradient partition) into ``stats``.

    ``extra`` names the statistics of ``EXTRA_STATISTICS`` to compute as well. No host
    synchronisation, no per-span Python; only the stock path keeps ``accumulate_spans``' own (on an
    accelerator, its non-finite check and small host-to-device copies). A partition of another dtype,
    or not contiguous, takes the stock path.
    """
    if flat.dim() != 1 or flat.numel() < chunking.end or stats.shape[0] < chunking.rows:
        raise ValueError(f"layer_grad_norms: a partition of {flat.numel()} elements and a table of "
                         f"{stats.shape[0]} buckets do not fit spans up to element {chunking.end} and bucket "
                         f"row {chunking.rows - 1}")
    if not flat.device == stats.device == chunking.chunks.device:
        raise ValueError(f"layer_grad_norms: partition on {flat.device}, statistics on {stats.device}, chunk "
                         f"list on {chunking.chunks.device}: they must be on one device")
    if chunking.kernel == STOCK or flat.dtype not in KERNEL_DTYPES or not flat.is_contiguous():
        accumulate_spans(stats, chunking.slices.views(flat), chunking.slices.buckets, extra)
        return
    bits = sum(EXTRA_BITS[name] for name in extra if name in EXTRA_BITS)
    if chunking.kernel == HOST:
        from .partition_stats_cpu import host_kernel

        host_kernel()(stats, flat, chunking.chunks, bits)
    else:
        from .partition_stats_triton import accumulate_chunks

        accumulate_chunks(stats, flat, chunking.chunks, bits)
