# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""How a gradient partition's spans are folded into the statistics table (``statistics``): with stock PyTorch
operators over the spans (``accumulate_spans``), or by a fused kernel where the partition's slices carry one
(``kernels.Chunking``), with the same results. The extra statistics (L1, sum, zeros) are computed only when
asked for.
"""

from typing import Collection, List, Optional, Sequence, Tuple

import torch

from . import statistics as columns
from .kernels import Chunking, chunk_partition
from .partition_slices import PartitionSlices, Span, slices_of_spans

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

    ``piece`` overrides the number of elements read at a time (``HOST_PIECE`` or ``DEVICE_PIECE``). Spans of any
    floating dtype are read; fp16 and bf16 pieces are converted one at a time into a scratch buffer, never as a
    whole. One host synchronisation per call: non-finite elements are counted only when a span's min or max says
    there are some, which keeps the common case to three reductions over the gradient.
    ``extra`` names the statistics of ``EXTRA_STATISTICS`` to compute as well.
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


def prepare_partition(spans: Sequence[Span], device) -> PartitionSlices:
    """The slices of one partition's ``spans`` on ``device`` (where the partition lives), as the statistics read
    them. With the fused kernels, a ``kernels.Chunking``: its chunk list built and its kernel picked now, at
    start-up, rather than in the first measured step."""
    return chunk_partition(slices_of_spans(list(spans), device), device)


def accumulate_partition(stats: torch.Tensor, flat: torch.Tensor, slices: PartitionSlices,
                         extra: Collection[str] = ()) -> None:
    """Fold the spans of ``slices`` in ``flat`` (this rank's 1-D gradient partition) into ``stats``.

    A ``kernels.Chunking`` reads them with its fused kernel where it can; the stock operators read the rest."""
    if not (isinstance(slices, Chunking) and slices.accumulate_fused(stats, flat, extra)):
        accumulate_spans(stats, slices.views(flat), slices.buckets, extra)
