# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The accelerator kernel of the fused statistics, in Triton (CUDA and ROCm).

Two stages, no host synchronisation: one program per entry of the chunk list reads its chunk once
and writes one partial row of the ``(buckets, 9)`` table (sums of squares, L1 and sum in float64;
min, max and abs-min compared as float, exact for fp32, bf16 and fp16); then the rows fold into the
table with the same ``scatter_add_`` and ``scatter_reduce_(amax)`` as ``partition_stats.accumulate_spans``,
so NaN handling is the same: a chunk with a NaN has NaN min, max and abs-min, and NaN stays. Under
``TRITON_INTERPRET=1`` (set before this module is imported) the same code runs on host tensors.
"""

import torch
import triton
import triton.language as tl

from .statistics import NUM_COLUMNS, NUM_SUMMED

BLOCK = 1024  # elements a program reads per step


@triton.jit
def _chunk_rows(flat, chunks, rows, extra, BLOCK: tl.constexpr, BF16: tl.constexpr, WITH_EXTRA: tl.constexpr):
    chunk = tl.program_id(0).to(tl.int64)
    start = tl.load(chunks + chunk * 3)
    length = tl.load(chunks + chunk * 3 + 1)
    sumsq = tl.zeros([BLOCK], dtype=tl.float64)
    l1 = tl.zeros([BLOCK], dtype=tl.float64)
    total = tl.zeros([BLOCK], dtype=tl.float64)
    nonfinite = tl.zeros([BLOCK], dtype=tl.int32)
    nans = tl.zeros([BLOCK], dtype=tl.int32)
    zeros = tl.zeros([BLOCK], dtype=tl.int32)
    high = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    low = tl.full([BLOCK], float("inf"), dtype=tl.float32)
    abs_low = tl.full([BLOCK], float("inf"), dtype=tl.float32)
    for offset in range(0, length, BLOCK):
        index = offset + tl.arange(0, BLOCK)
        inside = index < length
        if BF16:  # the upper half of a float: exact (Triton 3.9's interpreter gets bf16 subnormals wrong)
            bits = tl.load(flat.to(tl.pointer_type(tl.uint16)) + start + index, mask=inside, other=0)
            value = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            value = tl.load(flat + start + index, mask=inside, other=0.0).to(tl.float32)
        wide = value.to(tl.float64)
        magnitude = tl.abs(value)
        sumsq += wide * wide
        nonfinite += (inside & ~(magnitude < float("inf"))).to(tl.int32)
        nans += (inside & (value != value)).to(tl.int32)
        high = tl.maximum(high, tl.where(inside, value, float("-inf")))
        low = tl.minimum(low, tl.where(inside, value, float("inf")))
        abs_low = tl.minimum(abs_low, tl.where(inside, magnitude, float("inf")))
        if WITH_EXTRA:
            l1 += magnitude.to(tl.float64)
            total += wide
            zeros += (inside & (value == 0.0)).to(tl.int32)
    # Vector maximum and minimum may skip a NaN: a chunk with one reports NaN, as torch.aminmax does.
    has_nan = tl.sum(nans, axis=0) > 0
    row = rows + chunk * 9
    tl.store(row + 0, tl.sum(sumsq, axis=0))
    tl.store(row + 1, tl.sum(nonfinite, axis=0).to(tl.float64))
    tl.store(row + 2, tl.where((extra & 1) != 0, tl.sum(l1, axis=0), 0.0))
    tl.store(row + 3, tl.where((extra & 2) != 0, tl.sum(total, axis=0), 0.0))
    tl.store(row + 4, tl.where((extra & 4) != 0, tl.sum(zeros, axis=0).to(tl.float64), 0.0))
    tl.store(row + 5, length.to(tl.float64))
    tl.store(row + 6, tl.where(has_nan, float("nan"), tl.max(high, axis=0).to(tl.float64)))
    tl.store(row + 7, tl.where(has_nan, float("nan"), -tl.min(low, axis=0).to(tl.float64)))
    tl.store(row + 8, tl.where(has_nan, float("nan"), -tl.min(abs_low, axis=0).to(tl.float64)))


def accumulate_chunks(stats: torch.Tensor, flat: torch.Tensor, chunks: torch.Tensor, extra: int) -> None:
    """Fold the chunks ``(start, length, bucket row)`` of ``flat`` into ``stats``.

    ``extra``: bit 1 L1, bit 2 sum, bit 4 zeros. The caller has checked the chunk list against ``flat``
    and ``stats`` (``kernels.Chunking.accumulate_fused`` does). Three kernel launches, no synchronisation.
    """
    count = chunks.shape[0]
    if count == 0:
        return
    rows = torch.empty((count, NUM_COLUMNS), dtype=torch.float64, device=stats.device)
    _chunk_rows[(count, )](flat,
                           chunks,
                           rows,
                           extra,
                           BLOCK=BLOCK,
                           BF16=flat.dtype == torch.bfloat16,
                           WITH_EXTRA=extra != 0)
    buckets = chunks[:, 2:3]
    stats[:, :NUM_SUMMED].scatter_add_(0, buckets.expand(-1, NUM_SUMMED), rows[:, :NUM_SUMMED])
    stats[:, NUM_SUMMED:].scatter_reduce_(0,
                                          buckets.expand(-1, NUM_COLUMNS - NUM_SUMMED),
                                          rows[:, NUM_SUMMED:],
                                          reduce="amax")
