# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The statistics table: its rows and columns, its identity, and the reported statistics of each bucket.

Its columns are sums (squared norm, non-finite count, L1, sum, zeros, element count) and maxima (max, -min,
-abs_min), so spans, parameter groups and ranks combine the same way (``reduction``). A step's table holds the
gradient's buckets, one block of them per optimizer statistic, and a status row (``table_rows``).
"""

import math
from typing import Collection, Dict, Hashable, List, Optional, Sequence

import torch

SUMSQ, NONFINITE, L1, SUM, ZEROS, NUMEL, MAX, NEG_MIN, NEG_ABS_MIN = range(9)
NUM_SUMMED = 6  # columns before this one add up; the others take the maximum
NUM_COLUMNS = 9


def table_rows(num_buckets: int, kinds: Sequence[str] = ()) -> int:
    """The rows of a step's table: the gradient's buckets, one block of buckets per optimizer statistic,
    the status row."""
    return num_buckets * (1 + len(kinds)) + 1


def empty_stats(num_buckets: int, device) -> torch.Tensor:
    """The identity of the reduction: zero sums, ``-inf`` maxima."""
    return reset_stats(torch.empty((num_buckets, NUM_COLUMNS), dtype=torch.float64, device=device))


def reset_stats(stats: torch.Tensor) -> torch.Tensor:
    """``stats`` set to the identity of the reduction in place, and returned."""
    stats[:, :NUM_SUMMED].zero_()
    stats[:, NUM_SUMMED:].fill_(-math.inf)
    return stats


def bucket_results(stats: torch.Tensor,
                   keys: Sequence[Hashable],
                   selected: Sequence[Hashable],
                   multiplier: float,
                   extra: Collection[str] = (),
                   factors: Optional[Sequence[float]] = None) -> Dict[Hashable, Dict[str, float]]:
    """The reported statistics of the ``selected`` buckets, each value multiplied by ``multiplier`` (and by the
    bucket's own entry of ``factors``, the rows' multipliers, where given).

    ``multiplier`` is ``1 / loss_scale`` before clipping; clipping multiplies every gradient by one positive
    factor, so the post-clip statistics are the same table times that factor (counts are not multiplied); adaptive
    clipping multiplies each bucket by its own.
    """
    rows: List[List[float]] = stats.tolist()
    position = {key: index for index, key in enumerate(keys)}
    results = {}
    for key in selected:
        row = rows[position[key]]
        if row[NUMEL] == 0:
            continue  # no element anywhere: a frozen layer, or a pipeline spec without parameters
        row_multiplier = multiplier if factors is None else multiplier * factors[position[key]]
        result = {
            "norm": math.sqrt(row[SUMSQ]) * row_multiplier,
            "min": -row[NEG_MIN] * row_multiplier,
            "max": row[MAX] * row_multiplier,
            "abs_min": -row[NEG_ABS_MIN] * row_multiplier,
            "abs_max": max(row[MAX], row[NEG_MIN]) * row_multiplier,
            "nonfinite": int(row[NONFINITE]),
        }
        optional = {
            "l1": row[L1] * row_multiplier,
            "mean": row[SUM] / row[NUMEL] * row_multiplier,
            "zeros": int(row[ZEROS]),
            "numel": int(row[NUMEL])
        }
        result.update((name, optional[name]) for name in extra)
        results[key] = result
    return results


def total_norm(stats: torch.Tensor) -> float:
    """The L2 norm of all the buckets of a reduced table together."""
    return math.sqrt(stats[:, SUMSQ].sum().item())
