# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What an optimizer step did to each bucket (``optimizer_statistics``): the fp32 master weights after the
step, the Adam moments after it, and the update (after minus before).

The fp32 master partition and its moments have the layout of the flat gradient partition, so the gradient's
``Chunking`` reads each of them in one fused pass (``accumulate_partition``). The update is not read from a
copy of the partition taken before the step: it is derived from the weights and moments after the step and the
Adam family's rule (``AdamRule``): on the host by the C++ kernel, which reads each chunk of the weights and
moments once and folds all requested kinds from it (``accumulate_fused``); elsewhere piece by piece into one
bounded scratch buffer, each piece read with a chunking of its own window (``window_plans``). Optimizers whose
state is keyed per parameter (no ZeRO) are read the same way, each parameter as a partition of one span
(``parameter_statistics``).
"""

import inspect
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .config import OPTIMIZER_STATISTICS
from .partition_slices import PartitionSlices, slices_of_spans
from .partition_stats import HOST, Chunking, accumulate_partition, chunk_partition

MOMENTS = ("exp_avg", "exp_avg_sq")
NEEDS_ADAM = ("update", ) + MOMENTS
# The most elements one piece of a derived statistic (the update, or zeros) holds in the scratch buffer.
WINDOW = 1 << 20


@dataclass(frozen=True)
class AdamRule:
    """One parameter group's Adam step: ``p <- p * (1 - lr * wd) - a`` with decoupled weight decay (AdamW),
    ``p <- p - a`` with L2 in the gradient (Adam), where ``a = lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)``
    for the moments ``m``, ``v`` after the step and the bias corrections ``bc = 1 - beta ** step`` (1 without
    bias correction)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    bias_correction: bool

    def update_into(self, out: torch.Tensor, param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    step: float) -> torch.Tensor:
        """The update of one piece, written into ``out`` (same length): after minus before, in the order of
        operations torch's Adam uses, so that it matches the step to rounding."""
        bc1 = 1 - self.beta1**step if self.bias_correction else 1.0
        bc2 = 1 - self.beta2**step if self.bias_correction else 1.0
        torch.sqrt(exp_avg_sq, out=out).div_(math.sqrt(bc2)).add_(self.eps)
        torch.div(exp_avg, out, out=out).mul_(self.lr / bc1)
        if self.decoupled and self.weight_decay:
            decay = self.lr * self.weight_decay
            out.add_(param, alpha=decay).div_(1 - decay)
        return out.neg_()

    def coefficients(self, step: float) -> List[float]:
        """The host kernel's form of the rule at ``step``: step size ``lr / bc1``, ``sqrt(bc2)``, eps, the
        decoupled decay ``lr * weight_decay`` (0: none) and ``1 - decay``."""
        bc1 = 1 - self.beta1**step if self.bias_correction else 1.0
        bc2 = 1 - self.beta2**step if self.bias_correction else 1.0
        decay = self.lr * self.weight_decay if self.decoupled else 0.0
        return [self.lr / bc1, math.sqrt(bc2), self.eps, decay, 1 - decay]


def adam_rule(optimizer: torch.optim.Optimizer, group: dict) -> AdamRule:
    """The rule of ``optimizer``'s parameter ``group``; ``ValueError`` naming what is not supported."""
    decoupled = adam_decoupling(optimizer)
    for flag in ("amsgrad", "maximize"):
        if group.get(flag):
            raise ValueError(f"{type(optimizer).__name__} with {flag}=True")
    missing = [key for key in ("lr", "betas", "eps") if key not in group]
    if missing:
        raise ValueError(f"{type(optimizer).__name__} whose parameter group has no {missing[0]!r}")
    beta1, beta2 = group["betas"]
    return AdamRule(lr=float(group["lr"]),
                    beta1=float(beta1),
                    beta2=float(beta2),
                    eps=float(group["eps"]),
                    weight_decay=float(group.get("weight_decay", 0.0)),
                    decoupled=decoupled(group),
                    bias_correction=bool(group.get("bias_correction", True)))


def adam_decoupling(optimizer: torch.optim.Optimizer) -> Callable[[dict], bool]:
    """Whether a group of ``optimizer`` decays weights decoupled (AdamW) or as L2 in the gradient (Adam), for
    the Adam family whose semantics this module follows; ``ValueError`` naming any other optimizer.

    An optimizer is known by the step it runs, not by its class's ancestors: its class's ``step`` must be that of
    one of the known classes (a subclass that only changes ``__init__`` steps as its parent does; one with a
    ``step`` of its own may do anything, so the update derived from Adam's rule would be a guess)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    known = (torch.optim.Adam, torch.optim.AdamW, FusedAdam, DeepSpeedCPUAdam)
    step = inspect.unwrap(type(optimizer).step)  # torch wraps a class's step in a profiling hook
    if any(isinstance(optimizer, cls) and step is inspect.unwrap(cls.step) for cls in known):
        if isinstance(optimizer, torch.optim.Adam):  # AdamW: a subclass (torch 2.13) or not (older releases)
            return lambda group: isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))
        return lambda group: bool(optimizer.adam_w_mode)
    parent = next((cls.__name__ for cls in type(optimizer).__mro__ if cls in known), None)
    own = f", a subclass of {parent} with a step method of its own" if parent else ""
    raise ValueError(f"{type(optimizer).__name__}{own} (supported: torch.optim.Adam, torch.optim.AdamW, FusedAdam, "
                     "DeepSpeedCPUAdam, and subclasses that keep their step method)")


def window_plans(slices: PartitionSlices, device, window: int = WINDOW) -> List[Chunking]:
    """The chunkings of ``slices`` cut into windows of ``window`` elements, each relative to its window's
    start: window ``k`` reads elements ``[k * window, (k + 1) * window)`` of the partition."""
    end = max((start + length for start, length in zip(slices.starts, slices.lengths)), default=0)
    buckets = slices.buckets.tolist()
    plans = []
    for low in range(0, end, window):
        high = low + window
        spans = [(max(start, low) - low, min(start + length, high) - max(start, low), bucket)
                 for start, length, bucket in zip(slices.starts, slices.lengths, buckets)
                 if start < high and start + length > low]
        plans.append(chunk_partition(slices_of_spans(spans, device), device))
    return plans


def step_counter(optimizer: torch.optim.Optimizer, index: int, param: torch.Tensor) -> torch.Tensor:
    """The parameter whose state holds the step count the optimizer applied to ``param`` (of group ``index``):
    its own, except under FusedAdam with several parameters in a group (fp32 without ZeRO), which counts the
    group's steps in the state of the last parameter it steps only, and applies that count to all of them
    (DeepSpeed's engine gives every trainable parameter a gradient)."""
    from deepspeed.ops.adam import FusedAdam

    params = optimizer.param_groups[index]["params"]
    if not isinstance(optimizer, FusedAdam) or len(params) == 1:
        return param
    return [other for other in params if other.requires_grad][-1]


class GroupState:
    """One parameter group's fp32 master partition (or one parameter: ``parameter_statistics``), its optimizer
    state and hyper-parameters, and the plans that read them."""

    def __init__(self, optimizer: torch.optim.Optimizer, group_id: int, partition: torch.Tensor, plan: Chunking,
                 kinds: tuple, window: int) -> None:
        """``group_id``: the parameter group of ``optimizer`` that steps ``partition`` (its hyper-parameters)."""
        self.optimizer = optimizer
        self.group_id = group_id
        self.partition = partition
        self.plan = plan
        self.window = window
        derived = any(kind != "param" for kind in kinds)
        self.windows = window_plans(plan.slices, plan.chunks.device, window) if derived else []
        """Per-window plans: the update's pieces, and zero moments before the optimizer's first step."""
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
        if self.rule is None or self.plan.kernel != HOST or skipped or "exp_avg_sq" not in state:
            return False
        tensors = (self.partition, state["exp_avg"], state["exp_avg_sq"])
        if any(tensor.dtype != torch.float32 or not tensor.is_contiguous() for tensor in tensors):
            return False
        from .partition_stats_cpu import host_adam_kernel

        requested = [kind for kind in OPTIMIZER_STATISTICS if kind in kind_stats]
        bits = sum(1 << OPTIMIZER_STATISTICS.index(kind) for kind in requested)  # the kernel's order
        host_adam_kernel()([kind_stats[kind] for kind in requested], *map(_flat, tensors), self.plan.chunks,
                           self.rule.coefficients(self.step()), bits)
        return True

    def accumulate(self, kind: str, stats: torch.Tensor, scratch: torch.Tensor, skipped: bool) -> None:
        """Fold ``kind`` of this group into ``stats`` (its block of the table)."""
        state = self.state()
        if kind == "param":
            accumulate_partition(stats, _flat(self.partition), self.plan)
        elif kind in MOMENTS and kind in state:
            accumulate_partition(stats, _flat(state[kind]), self.plan)
        elif kind in MOMENTS or skipped or "exp_avg" not in state:  # no step yet, or a skipped one: zeros
            self._pieces(stats, scratch, lambda low, high, out: out.zero_())
        else:
            rule, step = self.rule, self.step()
            flat, exp_avg, exp_avg_sq = _flat(self.partition), _flat(state["exp_avg"]), _flat(state["exp_avg_sq"])
            self._pieces(
                stats, scratch, lambda low, high, out: rule.update_into(out, flat[low:high], exp_avg[low:high],
                                                                        exp_avg_sq[low:high], step))

    def _pieces(self, stats: torch.Tensor, scratch: torch.Tensor, fill) -> None:
        """A derived statistic, window by window: ``fill(low, high, out)`` writes elements ``[low, high)``
        into the scratch buffer, which that window's plan then reads."""
        window = self.window
        for number, plan in enumerate(self.windows):
            low = number * window
            high = min(low + window, self.partition.numel())
            out = fill(low, high, scratch[:high - low])
            accumulate_partition(stats, out, plan)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a partition, a parameter or its state: no copy (a tensor that has no such view fails)."""
    return tensor.detach().view(-1)


def optimizer_statistics(optimizer: torch.optim.Optimizer,
                         partitions: List[torch.Tensor],
                         plans: List[Chunking],
                         kinds: tuple,
                         group_ids: Optional[Sequence[int]] = None) -> Optional["OptimizerStatistics"]:
    """The reader of ``kinds`` for the fp32 master ``partitions`` that ``optimizer`` (the inner torch
    optimizer) steps, laid out as their gradients' ``plans``; ``None`` without kinds. ``group_ids``: the
    parameter group of ``optimizer`` that steps each partition (default: partition ``i`` is group ``i``)."""
    return OptimizerStatistics(optimizer, partitions, plans, kinds, group_ids=group_ids) if kinds else None


def parameter_statistics(optimizer: torch.optim.Optimizer, buckets: Sequence[Sequence[Optional[int]]],
                         kinds: tuple) -> Optional["OptimizerStatistics"]:
    """The reader of ``kinds`` for an optimizer whose state is keyed per parameter, each parameter read whole
    as a partition of one span: FP16_UnfusedOptimizer's fp32 copies, or the model's own parameters that a torch
    optimizer steps (fp32 without ZeRO). ``buckets[g][k]``: the bucket row of parameter ``k`` of
    ``optimizer``'s group ``g`` (``None``: not counted on this rank). ``None`` without kinds."""
    if not kinds:
        return None
    members = [(index, param, bucket) for index, group in enumerate(optimizer.param_groups)
               for param, bucket in zip(group["params"], buckets[index], strict=True) if bucket is not None]
    plans = [
        chunk_partition(slices_of_spans([(0, param.numel(), bucket)], param.device), param.device)
        for _, param, bucket in members
    ]
    return OptimizerStatistics(optimizer, [param for _, param, _ in members],
                               plans,
                               kinds,
                               group_ids=[index for index, _, _ in members])


class OptimizerStatistics:
    """The requested optimizer statistics of an optimizer: one ``GroupState`` per parameter group's fp32 master
    partition (or per parameter: ``parameter_statistics``), and one scratch buffer of at most ``WINDOW`` fp32
    elements for the derived ones."""

    def __init__(self,
                 optimizer: torch.optim.Optimizer,
                 partitions: List[torch.Tensor],
                 plans: List[Chunking],
                 kinds: tuple,
                 window: int = WINDOW,
                 group_ids: Optional[Sequence[int]] = None) -> None:
        """``window``: the scratch buffer's elements (tests make it small); ``group_ids``: the parameter group
        of each partition, where it is not the partition's index (ZeRO-3's sub-groups split a group in several
        partitions)."""
        self.kinds = kinds
        self.optimizer = optimizer
        self.reads_adam = any(kind in NEEDS_ADAM for kind in kinds)
        group_ids = range(len(partitions)) if group_ids is None else group_ids
        self.group_ids = sorted(set(group_ids))
        """The parameter groups of ``optimizer`` that the partitions belong to, each once."""
        self.groups = [
            GroupState(optimizer, group_id, partition, plan, kinds, window)
            for group_id, partition, plan in zip(group_ids, partitions, plans, strict=True)
        ]
        largest = min(window, max((partition.numel() for partition in partitions), default=0))
        self.scratch: Optional[torch.Tensor] = None
        if any(group.windows for group in self.groups):
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
        for group in self.groups:
            group.rule = rules[group.group_id]

    def accumulate(self, kind_stats: Dict[str, torch.Tensor], skipped: bool) -> None:
        """Fold every requested kind of every group into its block of the table; ``skipped``: the loss scaler
        skipped the step, so the update is zero."""
        for group in self.groups:
            if not group.accumulate_fused(kind_stats, skipped):
                for kind in self.kinds:
                    group.accumulate(kind, kind_stats[kind], self.scratch, skipped)
