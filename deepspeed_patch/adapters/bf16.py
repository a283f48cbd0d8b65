# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``BF16_Optimizer``: bf16 weights with fp32 gradient accumulation under ZeRO-1 (the BLOOM set-up).

Its flat gradient partitions are complete, reduced and carry no loss scale when the step begins, so
they are read then; once the step is done, its global norm gives the clip factor it applied. Each rank holds its
group's whole flat gradient, reduced (the partition is a view of it), and ``step()`` computes the global norm, and
clips, from every parameter's view of it: adaptive clipping scales all of it, on every rank.
"""

import functools
from typing import List

import torch
from deepspeed import comm as dist

from ..optimizer_state.optimizer_stats import optimizer_statistics
from ..statistics.clipping import bf16_clip_divisor
from ..statistics.measurement import Measurement
from ..statistics.partition_slices import Span, back_to_back_ranges, partition_spans
from ..statistics.partition_stats import prepare_partition
from .base import Setup
from .optimizer import OptimizerAdapter


class BF16Adapter(OptimizerAdapter):
    """Reads ``BF16_Optimizer``'s flat gradient partitions."""

    def __init__(self, optimizer, setup: Setup) -> None:
        device = optimizer.fp32_groups_gradients_flat[0].device
        self.partition_slices = [
            prepare_partition(_group_spans(optimizer, index, setup), device)
            for index in range(len(optimizer.bf16_groups))
        ]
        super().__init__(optimizer, setup, len(self.partition_slices), device)
        self.optimizer_statistics = optimizer_statistics(optimizer.optimizer, optimizer.fp32_groups_flat_partition,
                                                         self.partition_slices, self.kinds)

    @staticmethod
    def handles(optimizer) -> bool:
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

        return isinstance(optimizer, BF16_Optimizer)

    @staticmethod
    def trainable_params(optimizer) -> List[torch.nn.Parameter]:
        return [param for params in optimizer.bf16_groups for param in params]

    def read_at_begin(self, measurement: Measurement) -> None:
        for index, flat_grad in enumerate(self.optimizer.fp32_groups_gradient_flat_partition):
            measurement.observe_partition(index, flat_grad, self.partition_slices[index])

    def act_at_begin(self, measurement: Measurement) -> None:
        """With adaptive clipping, reduce the step now and scale each group's whole flat gradient in place (not only
        the partition: ``step()`` reads every parameter's gradient) before ``step()`` computes its global norm (which
        then is the norm after adaptive clipping, the same on every rank) and clips (not, once adaptive clipping
        replaces it)."""
        if self.remedy_step is None:
            return
        self.remedy_step.act(measurement)
        for index, flat_grad in enumerate(self.optimizer.fp32_groups_gradients_flat):
            self.scale_buckets(measurement, index, flat_grad)

    def spans_to_scale(self, index: int) -> List[Span]:
        """The group's whole flat gradient: its parameters back to back from 0."""
        params = self.optimizer.bf16_groups[index]
        return partition_spans(back_to_back_ranges(params, self.layer_map.bucket_of), 0,
                               sum(param.numel() for param in params))

    def clip_divisor(self, global_norm: float) -> float:
        return bf16_clip_divisor(global_norm, clip_grad=self.optimizer.clip_grad)

    def read_at_end(self, measurement: Measurement, overflow: bool) -> None:
        if not overflow:
            optimizer = self.optimizer
            measurement.set_applied_divisor_of_norm(
                optimizer._global_grad_norm, functools.partial(bf16_clip_divisor, clip_grad=optimizer.clip_grad))

    def overflow(self) -> bool:
        return self.capabilities.bf16_skips_steps and bool(self.optimizer.overflow)


def _group_spans(optimizer, index: int, setup: Setup) -> List[Span]:
    """Its flat buffer holds the parameters back to back (padding only at the end) and splits into equal
    data-parallel partitions."""
    process_group = optimizer.real_dp_process_group[index]
    partition_size = optimizer.bf16_groups_flat[index].numel() // dist.get_world_size(group=process_group)
    ranges = back_to_back_ranges(optimizer.bf16_groups[index], setup.bucket_of)
    start = dist.get_rank(group=process_group) * partition_size
    return partition_spans(ranges, start, partition_size)
