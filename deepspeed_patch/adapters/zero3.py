# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO stage 3 (``DeepSpeedZeroOptimizer_Stage3``).

Every parameter is partitioned over the data-parallel group: rank ``r`` holds elements
``[r * n, (r + 1) * n)`` of it, ``n`` being its ``partition_numel()``, the last rank's tail padding beyond
the parameter's ``ds_numel`` elements. The optimizer steps one sub-group at a time on a flat fp32
gradient that lays out the partitions of the sub-group's parameters back to back, averaged over ranks
and micro-steps and still multiplied by the loss scale, and hands it to ``unscale_and_clip_grads``:
that is where it is read, once per sub-group, padding left out. On a step the loss scaler skips, the
flat gradient is never built: the per-parameter partitions (or, with the optimizer offloaded, the flat
CPU gradient) are read in ``_update_scale``, before they are dropped.

The fp32 master weights of a sub-group (``fp32_partitioned_groups_flat``) have the layout of its flat gradient,
and the inner optimizer keeps their state under that flat tensor; it steps them with the hyper-parameters of the
parameter group the sub-group was cut from (``sub_group_to_group_id``).
"""

from typing import Dict, List, Optional

import torch
from deepspeed import comm as dist

from ..capabilities import Capabilities
from ..optimizer_state.optimizer_stats import optimizer_statistics
from ..statistics.partition_slices import PartitionSlices, Span, partition_spans
from ..statistics.partition_stats import prepare_partition
from .base import BucketOf, Setup
from .optimizer import ZeroPartitionsAdapter, observe_chunks


class Zero3Adapter(ZeroPartitionsAdapter):
    """Reads ``DeepSpeedZeroOptimizer_Stage3``'s flat fp32 gradient of each sub-group."""

    def __init__(self, optimizer, setup: Setup) -> None:
        device = optimizer.fp32_partitioned_groups_flat[0].device
        rank = dist.get_rank(group=optimizer.dp_process_group)
        self.partition_slices = [
            prepare_partition(_sub_group_spans(params, rank, setup.bucket_of), device)
            for params in optimizer.fp16_groups
        ]
        super().__init__(optimizer, setup, len(self.partition_slices), device)
        self.optimizer_statistics = optimizer_statistics(
            optimizer.optimizer,
            optimizer.fp32_partitioned_groups_flat,
            self.partition_slices,
            self.kinds,
            group_ids=[optimizer.sub_group_to_group_id[index] for index in range(len(self.partition_slices))])

    @staticmethod
    def handles(optimizer) -> bool:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

        return isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3)

    @staticmethod
    def trainable_params(optimizer) -> List[torch.nn.Parameter]:
        """The trainable parameters, sub-group by sub-group, each in the order of its flat gradient."""
        return [param for params in optimizer.fp16_groups for param in params]

    @staticmethod
    def unsupported(optimizer, names: Dict[torch.nn.Parameter, str], capabilities: Capabilities) -> List[str]:
        """Set-ups whose gradient partitions are not one partition per data-parallel rank on one device."""
        own_process_group = [
            names.get(param, "?") for params in optimizer.fp16_groups for param in params if
            not _same_ranks(getattr(param, "ds_process_group", optimizer.dp_process_group), optimizer.dp_process_group)
        ]
        shown = ", ".join(own_process_group[:3]) + (", ..." if len(own_process_group) > 3 else "")
        hpz = optimizer.zero_hpz_partition_size
        refusals = {
            "MiCS (its own shard groups)":
            capabilities.zero3_mics and _is_mics(optimizer),
            f"parameters partitioned over their own process group (ds_process_group: {shown})":
            bool(own_process_group),
            f"hpZ (zero_hpz_partition_size={hpz})":
            hpz > 1,
            "NVMe offload of the optimizer (offload_optimizer.device=nvme)":
            bool(optimizer.swap_optimizer),
            "NVMe offload of the parameters (offload_param.device=nvme)":
            bool(optimizer.params_in_nvme_and_cpu),
            f"partial optimizer offload (offload_optimizer.ratio={optimizer.partial_offload})":
            bool(optimizer.offload_optimizer) and optimizer.partial_offload != 1.0,
        }
        return [what for what, present in refusals.items() if present]

    @staticmethod
    def state_elsewhere(optimizer) -> List[str]:
        """Set-ups whose optimizer state is not all in this process's memory under the inner optimizer, keyed
        by each sub-group's fp32 partition, between steps (``refusals.check_optimizer_statistics``)."""
        dtype = getattr(optimizer, "master_weights_and_grads_dtype", torch.float32)  # older releases: always fp32
        offload = "zero_optimization.offload_optimizer"
        refusals = {
            f"{offload}.device=nvme (the state is swapped out to NVMe between sub-group steps)":
            bool(optimizer.swap_optimizer),
            f"{offload}.super_offload=true (the state is SuperOffload's CPU worker's)":
            _is_super_offload(optimizer),
            f"{offload}.ratio={optimizer.partial_offload} (a second optimizer steps the sub-groups on the device)":
            bool(optimizer.offload_optimizer) and optimizer.partial_offload != 1.0,
            f"master weights in {dtype} (fp16.fp16_master_weights_and_grads, bf16.bf16_master_weights_and_grads)":
            dtype != torch.float32,
        }
        return [what for what, present in refusals.items() if present]

    def unscale_and_clip_grads(self, sub_group_id, total_norm) -> None:
        """Top of ``unscale_and_clip_grads``, once per sub-group: its flat fp32 gradient about to be divided
        by the loss scale and the clip factor (and, with adaptive clipping, multiplied by each bucket's factor
        first)."""
        measurement = self.measurement
        if measurement is None:
            return
        with measurement.guarded("reading the gradient partition"):
            flat_grad = self.optimizer.fp32_partitioned_groups_flat[sub_group_id].grad
            # An invalid norm goes into the formula (clamped at 1) or, where the release checks it
            # (0.19.8), skips the step before this point: never a zeroed gradient.
            self.scale_buckets(measurement, sub_group_id, flat_grad)  # first: the divisor applied follows its outcome
            self.observe_flat(measurement, sub_group_id, flat_grad, total_norm, zeroes_invalid_norm=False)

    def spans_to_scale(self, index: int) -> List[Span]:
        rank = dist.get_rank(group=self.optimizer.dp_process_group)
        return _sub_group_spans(self.optimizer.fp16_groups[index], rank, self.layer_map.bucket_of)

    def observe_skipped(self, measurement, index: int, slices: PartitionSlices) -> None:
        """Sub-group ``index``'s gradient on a skipped step: the offloaded flat fp32 gradient, or the
        per-parameter partitions it would be flattened from."""
        optimizer = self.optimizer
        if optimizer.offload_optimizer:
            measurement.observe_partition(index, optimizer.fp32_partitioned_groups_flat[index].grad, slices)
        else:
            observe_chunks(measurement, index, slices, optimizer.averaged_gradients[index])


def _sub_group_spans(params: List[torch.nn.Parameter], rank: int, bucket_of: BucketOf) -> List[Span]:
    """The spans of one sub-group's flat gradient on ``rank``: each parameter's ``partition_numel()``
    elements back to back, of which the first ``ds_numel - rank * partition_numel()`` (none to all) are real."""
    ranges, offset = [], 0
    for param in params:
        size = param.partition_numel()
        real = min(size, max(0, param.ds_numel - rank * size))
        ranges.append((offset, real, bucket_of(param)))
        offset += size
    return partition_spans(ranges, 0, offset)


def _is_mics(optimizer) -> bool:
    from deepspeed.runtime.zero.mics import MiCS_Optimizer

    return isinstance(optimizer, MiCS_Optimizer)


def _is_super_offload(optimizer) -> bool:
    try:
        from deepspeed.runtime.superoffload.superoffload_stage3 import SuperOffloadOptimizer_Stage3
    except ImportError:  # a release without SuperOffload
        return False
    return isinstance(optimizer, SuperOffloadOptimizer_Stage3)


def _same_ranks(process_group: Optional[object], other: Optional[object]) -> bool:
    """Whether two process groups hold the same global ranks (the same group, or another handle of it)."""
    return process_group is other or _global_ranks(process_group) == _global_ranks(other)


def _global_ranks(process_group) -> List[int]:
    return [dist.get_global_rank(process_group, rank) for rank in range(dist.get_world_size(group=process_group))]
