# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Which slice of this rank's flat gradient partition belongs to which bucket.

ZeRO-1/2 (and BF16_Optimizer, and FP16_Optimizer on one rank) lays each parameter group out as one
flat buffer (parameters back to back, with optional alignment padding) and gives every data-parallel
rank one contiguous partition of it. The flat fp32 gradient partition the optimizer steps on has
exactly that layout, so a parameter's gradient on this rank is the intersection of its range in the
flat buffer with this rank's partition. Parameters cut by a partition boundary contribute their
local part; padding belongs to no slice.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from deepspeed import comm as dist


@dataclass(frozen=True)
class PartitionSlices:
    """Contiguous runs of one group's local partition, each inside a single bucket."""

    starts: Tuple[int, ...]
    lengths: Tuple[int, ...]
    buckets: torch.Tensor
    """Bucket position of each run (int64, on the device the statistics are computed on)."""

    def views(self, flat_partition: torch.Tensor) -> List[torch.Tensor]:
        """Views of ``flat_partition`` for each run; no copy."""
        return [flat_partition.narrow(0, start, length) for start, length in zip(self.starts, self.lengths)]


def partition_runs(param_ranges: Sequence[Tuple[int, int, Optional[int]]], partition_start: int,
                   partition_size: int) -> List[Tuple[int, int, int]]:
    """Runs ``(local_start, length, bucket)`` of one partition.

    ``param_ranges`` holds ``(offset, numel, bucket)`` of each parameter in the flat group buffer;
    a bucket of ``None`` leaves the parameter out (another rank counts it). Neighbouring parameters
    of the same bucket with no padding between them form one run.
    """
    partition_end = partition_start + partition_size
    runs: List[Tuple[int, int, int]] = []
    for offset, numel, bucket in param_ranges:
        start, end = max(offset, partition_start), min(offset + numel, partition_end)
        if bucket is None or start >= end:
            continue
        local_start = start - partition_start
        if runs and runs[-1][2] == bucket and runs[-1][0] + runs[-1][1] == local_start:
            last_start, last_length, _ = runs[-1]
            runs[-1] = (last_start, last_length + end - start, bucket)
        else:
            runs.append((local_start, end - start, bucket))
    return runs


def zero_partition_slices(optimizer, group_index: int, bucket_of, device) -> PartitionSlices:
    """The runs of ``DeepSpeedZeroOptimizer`` group ``group_index`` on this rank.

    Uses the optimizer's own layout bookkeeping: the parameter order and offsets of the flat group
    buffer (after round-robin reordering and alignment padding) and the data-parallel partitions.
    """
    params = optimizer.round_robin_bit16_groups[group_index]
    offsets = optimizer.round_robin_bit16_offsets[group_index]
    # The meta copies keep the true sizes when offload has swapped the parameters' storage out.
    sizes = [meta.numel() for meta in optimizer.round_robin_bit16_meta[group_index]]
    partitions = optimizer.parallel_partitioned_bit16_groups[group_index]
    rank = dist.get_rank(group=optimizer.real_dp_process_group[group_index])
    partition_start = sum(part.numel() for part in partitions[:rank])
    ranges = [(offset, size, bucket_of(param)) for param, offset, size in zip(params, offsets, sizes)]
    return slices_of_runs(partition_runs(ranges, partition_start, partitions[rank].numel()), device)


def bf16_partition_slices(optimizer, group_index: int, bucket_of, device) -> PartitionSlices:
    """The runs of ``BF16_Optimizer`` group ``group_index`` on this rank.

    Its flat buffer holds the parameters back to back (padding only at the end) and splits into
    equal data-parallel partitions.
    """
    group = optimizer.real_dp_process_group[group_index]
    partition_size = optimizer.bf16_groups_flat[group_index].numel() // dist.get_world_size(group=group)
    ranges = back_to_back_ranges(optimizer.bf16_groups[group_index], bucket_of)
    partition_start = dist.get_rank(group=group) * partition_size
    return slices_of_runs(partition_runs(ranges, partition_start, partition_size), device)


def fused_fp16_partition_slices(optimizer, group_index: int, bucket_of, device) -> PartitionSlices:
    """The runs of ``FP16_Optimizer`` group ``group_index``: one flat fp32 buffer of the whole group,
    parameters back to back, on every rank."""
    ranges = back_to_back_ranges(optimizer.fp16_groups[group_index], bucket_of)
    return slices_of_runs(partition_runs(ranges, 0, optimizer.fp32_groups_flat[group_index].numel()), device)


def back_to_back_ranges(params, bucket_of) -> List[Tuple[int, int, Optional[int]]]:
    """``(offset, numel, bucket)`` of parameters laid out with no padding between them."""
    ranges, offset = [], 0
    for param in params:
        ranges.append((offset, param.numel(), bucket_of(param)))
        offset += param.numel()
    return ranges


def slices_of_runs(runs: List[Tuple[int, int, int]], device=None) -> PartitionSlices:
    """The ``PartitionSlices`` of runs ``(local_start, length, bucket)``."""
    return PartitionSlices(starts=tuple(run[0] for run in runs),
                           lengths=tuple(run[1] for run in runs),
                           buckets=torch.tensor([run[2] for run in runs], dtype=torch.int64, device=device))
