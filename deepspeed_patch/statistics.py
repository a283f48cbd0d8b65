# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Per-bucket gradient statistics: the table's columns, local partial results, the reported dict.

Each rank folds the runs of its local gradient partition into one small ``(buckets, 9)`` float64
table: in one read by a fused kernel where one is available (C++ and OpenMP on the host,
``partition_stats_cpu``; Triton on CUDA and ROCm, ``partition_stats_triton``), else with stock
PyTorch operators over the runs (``accumulate_runs``), with the same results. Sums (squared norm,
non-finite count, L1, sum, zeros, element count) and maxima (max, -min, -abs_min) combine the same
way across runs, parameter groups and ranks, so the tables of all ranks reduce (``reduction``) to the
statistics of the full gradient whatever the number of buckets. The extra statistics (L1, sum,
zeros) are computed only when asked for.
"""

import functools
import math
from dataclasses import dataclass
from typing import Collection, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
from deepspeed.utils import logger

from .partition_slices import PartitionSlices

SUMSQ, NONFINITE, L1, SUM, ZEROS, NUMEL, MAX, NEG_MIN, NEG_ABS_MIN = range(9)
NUM_SUMMED = 6  # columns before this one add up; the others take the maximum
NUM_COLUMNS = 9
# Runs are read piece by piece, each piece three times in a row (squared norm, min and max, |x| into a
# scratch buffer for abs_min). On the host a piece of 2 MiB of fp32 stays in the CPU's cache between those
# reads, so the partition comes from memory about once; elsewhere pieces only bound the scratch buffer.
HOST_PIECE = 1 << 19
DEVICE_PIECE = 1 << 22


def empty_stats(num_buckets: int, device) -> torch.Tensor:
    """The identity of the reduction: zero sums, ``-inf`` maxima."""
    return reset_stats(torch.empty((num_buckets, NUM_COLUMNS), dtype=torch.float64, device=device))


def reset_stats(stats: torch.Tensor) -> torch.Tensor:
    """``stats`` set to the identity of the reduction in place, and returned."""
    stats[:, :NUM_SUMMED].zero_()
    stats[:, NUM_SUMMED:].fill_(-math.inf)
    return stats


def accumulate_runs(stats: torch.Tensor,
                    runs: Sequence[torch.Tensor],
                    buckets: torch.Tensor,
                    extra: Collection[str] = (),
                    piece: Optional[int] = None) -> None:
    """Fold the statistics of ``runs`` (1-D gradient slices) into their ``buckets`` rows of ``stats``.

    ``extra`` names the statistics of ``EXTRA_STATISTICS`` to compute as well; ``piece`` overrides the
    number of elements read at a time (``HOST_PIECE`` or ``DEVICE_PIECE``). Runs of any floating dtype
    are read; fp16 and bf16 pieces are converted one at a time into a scratch buffer, never as a whole.
    One host synchronisation per call: non-finite elements are counted only when a run's min or max says
    there are some, which keeps the common case to three reductions over the gradient.
    """
    if not runs:
        return
    piece = piece or (HOST_PIECE if runs[0].device.type == "cpu" else DEVICE_PIECE)
    pieces: List[torch.Tensor] = []
    owners: List[int] = []
    for index, run in enumerate(runs):
        split = run.split(piece)
        pieces.extend(split)
        owners.extend([index] * len(split))
    scratch = torch.empty(max(piece.numel() for piece in pieces), dtype=torch.float32, device=pieces[0].device)
    sumsq, lows, highs, abs_mins = _piece_statistics(pieces, scratch)
    per_piece = torch.zeros((len(pieces), NUM_COLUMNS), dtype=torch.float64, device=stats.device)
    per_piece[:, SUMSQ] = sumsq
    min_max = torch.stack([lows, highs], dim=1).double()
    per_piece[:, MAX], per_piece[:, NEG_MIN] = min_max[:, 1], -min_max[:, 0]
    per_piece[:, NEG_ABS_MIN] = -abs_mins.double()
    per_piece[:, NUMEL] = torch.tensor([piece.numel() for piece in pieces], dtype=torch.float64)
    if "l1" in extra:
        per_piece[:, L1] = torch.stack([torch.linalg.vector_norm(p, 1, dtype=torch.float64) for p in pieces])
    if "mean" in extra:
        per_piece[:, SUM] = torch.stack([piece.sum(dtype=torch.float64) for piece in pieces])
    if "zeros" in extra:
        per_piece[:, ZEROS] = per_piece[:, NUMEL] - torch.stack([torch.count_nonzero(p) for p in pieces]).double()
    finite = torch.isfinite(min_max).all(dim=1)
    if not bool(finite.all()):  # a NaN or an infinity makes its piece's min or max non-finite
        for index in torch.nonzero(~finite).flatten().tolist():
            per_piece[index, NONFINITE] = _count_nonfinite(pieces[index], scratch)
    piece_buckets = buckets if len(pieces) == len(runs) else buckets[torch.tensor(owners, device=buckets.device)]
    index = piece_buckets.unsqueeze(1).expand(-1, NUM_SUMMED)
    stats[:, :NUM_SUMMED].scatter_add_(0, index, per_piece[:, :NUM_SUMMED])
    index = piece_buckets.unsqueeze(1).expand(-1, NUM_COLUMNS - NUM_SUMMED)
    stats[:, NUM_SUMMED:].scatter_reduce_(0, index, per_piece[:, NUM_SUMMED:], reduce="amax")


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


def bucket_results(stats: torch.Tensor,
                   keys: Sequence[Hashable],
                   selected: Sequence[Hashable],
                   scale: float,
                   extra: Collection[str] = ()) -> Dict[Hashable, Dict[str, float]]:
    """The reported statistics of the ``selected`` buckets, each value multiplied by ``scale``.

    ``scale`` is ``1 / loss_scale`` before clipping; clipping multiplies every gradient by one positive
    factor, so the post-clip statistics are the same table times that factor (counts do not scale).
    """
    rows: List[List[float]] = stats.tolist()
    position = {key: index for index, key in enumerate(keys)}
    results = {}
    for key in selected:
        row = rows[position[key]]
        if row[NUMEL] == 0:
            continue  # no element anywhere: a frozen layer, or a pipeline spec without parameters
        result = {
            "norm": math.sqrt(row[SUMSQ]) * scale,
            "min": -row[NEG_MIN] * scale,
            "max": row[MAX] * scale,
            "abs_min": -row[NEG_ABS_MIN] * scale,
            "abs_max": max(row[MAX], row[NEG_MIN]) * scale,
            "nonfinite": int(row[NONFINITE]),
        }
        optional = {
            "l1": row[L1] * scale,
            "mean": row[SUM] / row[NUMEL] * scale,
            "zeros": int(row[ZEROS]),
            "numel": int(row[NUMEL])
        }
        result.update((name, optional[name]) for name in extra)
        results[key] = result
    return results


def total_norm(stats: torch.Tensor) -> float:
    """The L2 norm of all the buckets of a reduced table together."""
    return math.sqrt(stats[:, SUMSQ].sum().item())
