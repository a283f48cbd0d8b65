# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO stage 1 and 2 (``DeepSpeedZeroOptimizer``).

Each rank holds one contiguous partition of every parameter group's flat buffer. The optimizer builds
that partition's fp32 gradient, averaged over ranks and micro-steps and still multiplied by the loss
scale, and hands it to ``unscale_and_clip_grads``: that is where it is read, once per parameter group. On a step
the loss scaler skips, the partition is never built: its per-parameter pieces are read in
``_update_scale``, before they are dropped.
"""

import itertools
from typing import List

import torch
from deepspeed import comm as dist

from ..capabilities import Capabilities
from ..optimizer_state.optimizer_stats import optimizer_statistics
from ..statistics.partition_slices import PartitionSlices, Span, partition_spans
from ..statistics.partition_stats import prepare_partition
from .base import BucketOf, Setup
from .optimizer import ZeroPartitionsAdapter, observe_chunks, param_group_of


class ZeroAdapter(ZeroPartitionsAdapter):
    """Reads ``DeepSpeedZeroOptimizer``'s flat fp32 gradient partitions."""

    def __init__(self, optimizer, setup: Setup) -> None:
        device = optimizer.single_partition_of_fp32_groups[0].device
        self.partition_slices = [
            prepare_partition(_group_spans(optimizer, index, setup.bucket_of, setup.capabilities), device)
            for index in range(len(optimizer.bit16_groups))
        ]
        super().__init__(optimizer, setup, len(self.partition_slices), device)
        self.optimizer_statistics = optimizer_statistics(optimizer.optimizer,
                                                         optimizer.single_partition_of_fp32_groups,
                                                         self.partition_slices, self.kinds)

    @staticmethod
    def handles(optimizer) -> bool:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        return isinstance(optimizer, DeepSpeedZeroOptimizer)

    @staticmethod
    def trainable_params(optimizer) -> List[torch.nn.Parameter]:
        """The trainable parameters, parameter group by parameter group, each in the order of its flat buffer."""
        return [param for params in optimizer.bit16_groups for param in params]

    def unscale_and_clip_grads(self, grad_groups_flat, total_norm) -> None:
        """Top of ``unscale_and_clip_grads``, once per parameter group: the flat fp32 partition about to be divided by
        the loss scale and the clip factor (and, with adaptive clipping, multiplied by each bucket's factor
        first). The global norm stays on the device until ``finish``."""
        measurement = self.measurement
        if measurement is None:
            return
        with measurement.guarded("reading the gradient partition"):
            flat_grad = grad_groups_flat[0]
            index = param_group_of(self.optimizer.single_partition_of_fp32_groups, flat_grad)
            self.scale_buckets(measurement, index, flat_grad)  # first: the divisor applied follows its outcome
            self.observe_flat(measurement, index, flat_grad, total_norm, self.capabilities.zero_zeroes_invalid_norm)

    def spans_to_scale(self, index: int) -> List[Span]:
        return _group_spans(self.optimizer, index, self.layer_map.bucket_of, self.capabilities)

    def observe_skipped(self, measurement, index: int, slices: PartitionSlices) -> None:
        """Group ``index``'s gradient on a skipped step: the offloaded fp32 partition, the flat partition a
        pre-flattening pass left, or the per-parameter pieces (fp16) the partition would be built from."""
        optimizer = self.optimizer
        if optimizer.cpu_offload:
            measurement.observe_partition(index, optimizer.single_partition_of_fp32_groups[index].grad, slices)
            return
        pieces = optimizer.averaged_gradients[index]
        flat = getattr(pieces, "flat_partition", None)
        if flat is not None:
            measurement.observe_partition(index, flat.view(-1), slices)
        else:
            observe_chunks(measurement, index, slices, pieces)


def _group_spans(optimizer, index: int, bucket_of: BucketOf, capabilities: Capabilities) -> List[Span]:
    """The spans of parameter group ``index`` on this rank, from the optimizer's own layout bookkeeping: the parameter
    order and offsets of the flat buffer (after round-robin reordering and alignment padding) and the data-parallel
    partitions. ``capabilities``: whether the release records the offsets (``zero_records_offsets``)."""
    params = optimizer.round_robin_bit16_groups[index]
    # The meta copies keep the true sizes when offload has swapped the parameters' storage out.
    sizes = [meta.numel() for meta in optimizer.round_robin_bit16_meta[index]]
    if capabilities.zero_records_offsets:  # it may pad between parameters, and says where
        offsets = optimizer.round_robin_bit16_offsets[index]
    else:  # back to back, the padding at the end
        offsets = list(itertools.accumulate(sizes[:-1], initial=0))
    partitions = optimizer.parallel_partitioned_bit16_groups[index]
    rank = dist.get_rank(group=optimizer.real_dp_process_group[index])
    start = sum(part.numel() for part in partitions[:rank])
    ranges = [(offset, size, bucket_of(param)) for param, offset, size in zip(params, offsets, sizes)]
    return partition_spans(ranges, start, partitions[rank].numel())
