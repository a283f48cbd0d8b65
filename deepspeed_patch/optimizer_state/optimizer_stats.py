# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What an optimizer step did to each bucket (``optimizer_statistics``): the fp32 master weights after the
step, the Adam moments after it, and the update (after minus before).

The fp32 master partition and its moments have the layout of the flat gradient partition, so the gradient's
slices read each of them in one pass (``accumulate_partition``). The update is not read from a
copy of the partition taken before the step: it is derived from the weights and moments after the step and the
Adam family's rule (``adam_rule.AdamRule``): on the host by the C++ kernel, which reads each chunk of the weights
and moments once and folds all requested kinds from it (``accumulate_fused``); elsewhere piece by piece into one
bounded scratch buffer, each piece read with slices of its own (``cut_into_pieces``). Each
partition's tensors, state and slices are held by one ``PartitionState``. Optimizers whose state is keyed
per parameter (no ZeRO) are read the same way, each parameter as a partition of one run
(``parameter_statistics``).
"""

from typing import Dict, List, Optional, Sequence

import torch

from ..config import OPTIMIZER_STATISTICS
from ..statistics.kernels import HOST, Chunking
from ..statistics.partition_slices import PartitionSlices
from ..statistics.partition_stats import accumulate_partition, prepare_partition
from .adam_rule import MOMENTS, NEEDS_ADAM, AdamRule, adam_rule, step_counter

# The most elements one piece of a derived statistic (the update, or zeros) holds in the scratch buffer.
PIECE = 1 << 20


def cut_into_pieces(slices: PartitionSlices, device, piece: int = PIECE) -> List[PartitionSlices]:
    """The slices of ``slices`` cut into pieces of ``piece`` elements, each relative to its piece's
    start: piece ``k`` reads elements ``[k * piece, (k + 1) * piece)`` of the partition."""
    end = max((start + length for start, length in zip(slices.starts, slices.lengths)), default=0)
    buckets = slices.buckets.tolist()
    pieces = []
    for low in range(0, end, piece):
        high = low + piece
        spans = [(max(start, low) - low, min(start + length, high) - max(start, low), bucket)
                 for start, length, bucket in zip(slices.starts, slices.lengths, buckets)
                 if start < high and start + length > low]
        pieces.append(prepare_partition(spans, device))
    return pieces


class PartitionState:
    """One fp32 master partition (a parameter group's under ZeRO, a sub-group's under ZeRO-3, or one parameter:
    ``parameter_statistics``), its optimizer state and hyper-parameters, and the slices that read them."""

    def __init__(self, optimizer: torch.optim.Optimizer, group_id: int, partition: torch.Tensor,
                 slices: PartitionSlices, kinds: tuple, piece: int) -> None:
        """``group_id``: the parameter group of ``optimizer`` that steps ``partition`` (its hyper-parameters)."""
        self.optimizer = optimizer
        self.group_id = group_id
        self.partition = partition
        self.slices = slices
        self.piece = piece
        derived = any(kind != "param" for kind in kinds)
        self.pieces = cut_into_pieces(slices, partition.device, piece) if derived else []
        """Per-piece slices: the update's, and zero moments before the optimizer's first step."""
        reads_adam = any(kind in NEEDS_ADAM for kind in kinds)
        self.rule: Optional[AdamRule] = None
        """The step's rule, as its parameter group stood when the step began (``OptimizerStatistics.begin_step``)."""
        self.counter = step_counter(optimizer, group_id, partition) if reads_adam else partition
        """The parameter whose state counts the steps the rule applies (``step_counter``)."""

    def state(self) -> dict:
        return self.optimizer.state.get(self.partition, {})

    def step(self) -> float:
        return float(self.optimizer.state[self.counter]["step"])

    def accumulate_fused(self, kind_stats: Dict[str, torch.Tensor], skipped: bool) -> bool:
        """Every requested kind in one read of the weights and moments by the host kernel, where it applies (fp32
        on the host, after a step of an Adam optimizer that was not skipped); whether it did."""
        state = self.state()
        fused = isinstance(self.slices, Chunking) and self.slices.kernel == HOST
        if self.rule is None or not fused or skipped or "exp_avg_sq" not in state:
            return False
        tensors = (self.partition, state["exp_avg"], state["exp_avg_sq"])
        if any(tensor.dtype != torch.float32 or not tensor.is_contiguous() for tensor in tensors):
            return False
        from ..statistics.partition_stats_cpu import host_adam_kernel

        requested = [kind for kind in OPTIMIZER_STATISTICS if kind in kind_stats]
        bits = sum(1 << OPTIMIZER_STATISTICS.index(kind) for kind in requested)  # the kernel's order
        host_adam_kernel()([kind_stats[kind] for kind in requested], *map(_flat, tensors), self.slices.chunks,
                           self.rule.coefficients(self.step()), bits)
        return True

    def accumulate(self, kind: str, stats: torch.Tensor, scratch: torch.Tensor, skipped: bool) -> None:
        """Fold ``kind`` of this partition into ``stats`` (its block of the table)."""
        state = self.state()
        if kind == "param":
            accumulate_partition(stats, _flat(self.partition), self.slices)
        elif kind in MOMENTS and kind in state:
            accumulate_partition(stats, _flat(state[kind]), self.slices)
        elif kind in MOMENTS or skipped or "exp_avg" not in state:  # no step yet, or a skipped one: zeros
            self._pieces(stats, scratch, lambda low, high, out: out.zero_())
        else:
            rule, step = self.rule, self.step()
            flat, exp_avg, exp_avg_sq = _flat(self.partition), _flat(state["exp_avg"]), _flat(state["exp_avg_sq"])
            self._pieces(
                stats, scratch, lambda low, high, out: rule.update_into(out, flat[low:high], exp_avg[low:high],
                                                                        exp_avg_sq[low:high], step))

    def _pieces(self, stats: torch.Tensor, scratch: torch.Tensor, fill) -> None:
        """A derived statistic, piece by piece: ``fill(low, high, out)`` writes elements ``[low, high)``
        into the scratch buffer, which that piece's slices then read."""
        piece = self.piece
        for number, slices in enumerate(self.pieces):
            low = number * piece
            high = min(low + piece, self.partition.numel())
            out = fill(low, high, scratch[:high - low])
            accumulate_partition(stats, out, slices)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a partition, a parameter or its state: no copy (a tensor that has no such view fails)."""
    return tensor.detach().view(-1)


def optimizer_statistics(optimizer: torch.optim.Optimizer,
                         partitions: List[torch.Tensor],
                         partition_slices: List[PartitionSlices],
                         kinds: tuple,
                         group_ids: Optional[Sequence[int]] = None) -> Optional["OptimizerStatistics"]:
    """The reader of ``kinds`` for the fp32 master ``partitions`` that ``optimizer`` (the inner torch
    optimizer) steps, laid out as their gradients' ``partition_slices``; ``None`` without kinds. ``group_ids``: the
    parameter group of ``optimizer`` that steps each partition (default: partition ``i`` is group ``i``)."""
    return OptimizerStatistics(optimizer, partitions, partition_slices, kinds, group_ids=group_ids) if kinds else None


def parameter_statistics(optimizer: torch.optim.Optimizer, buckets: Sequence[Sequence[Optional[int]]],
                         kinds: tuple) -> Optional["OptimizerStatistics"]:
    """The reader of ``kinds`` for an optimizer whose state is keyed per parameter, each parameter read whole
    as a partition of one run: FP16_UnfusedOptimizer's fp32 copies, or the model's own parameters that a torch
    optimizer steps (fp32 without ZeRO). ``buckets[g][k]``: the bucket row of parameter ``k`` of
    ``optimizer``'s group ``g`` (``None``: not counted on this rank). ``None`` without kinds."""
    if not kinds:
        return None
    members = [(index, param, bucket) for index, group in enumerate(optimizer.param_groups)
               for param, bucket in zip(group["params"], buckets[index], strict=True) if bucket is not None]
    partition_slices = [prepare_partition([(0, param.numel(), bucket)], param.device) for _, param, bucket in members]
    return OptimizerStatistics(optimizer, [param for _, param, _ in members],
                               partition_slices,
                               kinds,
                               group_ids=[index for index, _, _ in members])


class OptimizerStatistics:
    """The requested optimizer statistics of an optimizer: one ``PartitionState`` per fp32 master partition (or
    per parameter: ``parameter_statistics``), and one scratch buffer of at most ``PIECE`` fp32 elements for the
    derived ones."""

    def __init__(self,
                 optimizer: torch.optim.Optimizer,
                 partitions: List[torch.Tensor],
                 partition_slices: List[PartitionSlices],
                 kinds: tuple,
                 piece: int = PIECE,
                 group_ids: Optional[Sequence[int]] = None) -> None:
        """``piece``: the scratch buffer's elements (tests make it small); ``group_ids``: the parameter group
        of each partition, where it is not the partition's index (ZeRO-3's sub-groups split a group in several
        partitions)."""
        self.kinds = kinds
        self.optimizer = optimizer
        self.reads_adam = any(kind in NEEDS_ADAM for kind in kinds)
        group_ids = range(len(partitions)) if group_ids is None else group_ids
        self.group_ids = sorted(set(group_ids))
        """The parameter groups of ``optimizer`` that the partitions belong to, each once."""
        self.states = [
            PartitionState(optimizer, group_id, partition, slices, kinds, piece)
            for group_id, partition, slices in zip(group_ids, partitions, partition_slices, strict=True)
        ]
        largest = min(piece, max((partition.numel() for partition in partitions), default=0))
        self.scratch: Optional[torch.Tensor] = None
        if any(state.pieces for state in self.states):
            self.scratch = torch.empty(largest, dtype=torch.float32, device=partitions[0].device)

    def begin_step(self) -> None:
        """At the top of a step the statistics will read, keep the rule the step will apply, once per parameter
        group (partitions and parameters share their group's): the engine steps its lr scheduler after the
        optimizer's step and before the statistics read the state, so the groups' hyper-parameters by then are
        the next step's."""
        if not self.reads_adam:
            return
        param_groups = self.optimizer.param_groups
        rules = {group_id: adam_rule(self.optimizer, param_groups[group_id]) for group_id in self.group_ids}
        for state in self.states:
            state.rule = rules[state.group_id]

    def accumulate(self, kind_stats: Dict[str, torch.Tensor], skipped: bool) -> None:
        """Fold every requested kind of every partition into its block of the table; ``skipped``: the loss
        scaler skipped the step, so the update is zero."""
        for state in self.states:
            if not state.accumulate_fused(kind_stats, skipped):
                for kind in self.kinds:
                    state.accumulate(kind, kind_stats[kind], self.scratch, skipped)
