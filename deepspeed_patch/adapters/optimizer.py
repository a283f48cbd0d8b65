# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What the adapters of DeepSpeed's optimizers share beyond the step protocol (``base``): the overflow and global
norm the optimizer reports (``OptimizerAdapter``), ZeRO's flat gradient partitions (``ZeroPartitionsAdapter``),
and the reading of flat partitions (``observe_chunks``, ``param_group_of``)."""

import functools
from typing import Dict, List, Optional, Sequence

import torch

from ..capabilities import Capabilities
from ..remedies.remedies import Remedies
from ..remedies.remedy_step import RemedyStep
from ..statistics.clipping import zero_unscale_divisor
from ..statistics.measurement import Measurement
from ..statistics.partition_slices import PartitionSlices, Span
from .base import LayerGradNormsAdapter, Setup


class OptimizerAdapter(LayerGradNormsAdapter):
    """An adapter of a DeepSpeed optimizer that reports its own loss-scaler overflow and global norm."""

    def __init__(self, optimizer, setup: Setup, num_partitions: int, device) -> None:
        self.optimizer = optimizer
        self.capabilities = setup.capabilities
        self.saved_clip_grad: Optional[float] = None
        """The optimizer's ``clip_grad`` while adaptive clipping replaces it for one step
        (``suspend_global_clipping``)."""
        super().__init__(setup, num_partitions, device)
        remedies = Remedies.wanted(setup.config, self.layer_map.keys, self.layer_map.num_rows, self.losses)
        if remedies is not None:
            self.remedy_step = RemedyStep(remedies, self, self.latch, setup.process_group)

    @staticmethod
    def unsupported(optimizer, names: Dict[torch.nn.Parameter, str], capabilities: Capabilities) -> List[str]:
        """The features of this ``optimizer`` the family cannot measure, named for the refusal at initialize
        (``names``: the engine's parameter names)."""
        return []

    def scale_buckets(self, measurement: Measurement, index: int, flat_grad: torch.Tensor) -> None:
        """A read point's flat gradient ``index``, multiplied by the step's adaptive factors if it has them
        (``RemedyStep.scale``), before the optimizer unscales and clips it."""
        if self.remedy_step is not None:
            self.remedy_step.scale(measurement, index, flat_grad)

    def clip_divisor(self, global_norm: float) -> float:
        """What the optimizer's global clipping divides a gradient of unscaled norm ``global_norm`` by."""
        raise NotImplementedError

    def applied_multiplier(self, measurement: Measurement) -> float:
        """What the optimizer multiplied the step's gradient by, unscaled and after the adaptive factors: the global
        clip coefficient of the step's global norm (1 while adaptive clipping suspends it). At the end of the step,
        before global clipping is restored."""
        return 1.0 / self.clip_divisor(measurement.action.global_norm)

    def spans_to_scale(self, index: int) -> List[Span]:
        """The spans of flat gradient ``index`` (the one ``scale_buckets`` gets) of every parameter, by its bucket
        (``LayerMap.bucket_of``): a copy that another rank counts (a tensor-parallel replica, a pipeline-tied
        copy) included, so that every copy of a parameter gets the same factor (DESIGN.md 2b)."""
        raise NotImplementedError

    def skip_optimizer_step(self) -> None:
        """Make the optimizer skip the step under way as it skips an overflowed one (refused where it cannot)."""
        raise NotImplementedError

    def end_skip(self) -> None:
        """Top of the step after one ``skip_optimizer_step`` skipped: the optimizer steps again."""

    def suspend_global_clipping(self) -> None:
        """No global clipping for the step under way (adaptive clipping replaces it); ``end_step`` restores it."""
        self.saved_clip_grad = self.optimizer.clip_grad
        self.optimizer.clip_grad = 0.0

    def resume_global_clipping(self) -> None:
        """Global clipping as it was before ``suspend_global_clipping``, if it was suspended."""
        if self.saved_clip_grad is not None:
            self.optimizer.clip_grad, self.saved_clip_grad = self.saved_clip_grad, None

    def overflow(self) -> bool:
        return bool(self.optimizer.overflow)

    def global_norm(self) -> Optional[float]:
        return self.optimizer._global_grad_norm


class ZeroPartitionsAdapter(OptimizerAdapter):
    """ZeRO's optimizers (stages 1 to 3): each flat fp32 gradient partition (of a parameter group; of a sub-group
    in stage 3), still multiplied by the loss scale, is read in ``unscale_and_clip_grads``; on a step the loss
    scaler skips, in ``_update_scale``, before the gradients are dropped. ``partition_slices``: each partition's
    slices."""

    partition_slices: List[PartitionSlices]
    skipping = False
    """``skip_optimizer_step`` set the optimizer's ``overflow`` for the step under way."""

    def observe_flat(self, measurement: Measurement, index: int, flat_grad: torch.Tensor, total_norm,
                     zeroes_invalid_norm: bool) -> None:
        """Fold in flat partition ``index`` and record what ``unscale_and_clip_grads`` divides it by,
        for the global norm (times the loss scale) ``total_norm``, which stays on the device until ``finish``."""
        optimizer = self.optimizer
        measurement.observe_partition(index, flat_grad, self.partition_slices[index])
        measurement.set_applied_divisor_of_norm(
            total_norm,
            functools.partial(zero_unscale_divisor,
                              clip_grad=optimizer.clip_grad,
                              loss_scale=optimizer.loss_scale,
                              zeroes_invalid_norm=zeroes_invalid_norm))

    def update_scale(self, has_overflow=False) -> None:
        """Top of ``_update_scale``: once per step, before the loss scale changes and before a skipped
        step's gradients are dropped. With a remedy on, a step the loss scaler does not skip is read here
        too, and reduced, for the remedies to act before the optimizer steps (``act``)."""
        measurement = self.measurement
        if measurement is None:
            return
        acting = self.remedy_step is not None and not has_overflow
        with measurement.guarded("reading the gradients before the step"):
            measurement.set_gradient_scale(self.optimizer.loss_scale)
            if has_overflow or acting:
                for index, slices in enumerate(self.partition_slices):
                    self.observe_skipped(measurement, index, slices)
        if acting:
            self.remedy_step.act(measurement)
        elif self.remedy_step is not None:
            self.remedy_step.overflowed(measurement)

    def clip_divisor(self, global_norm: float) -> float:
        return zero_unscale_divisor(global_norm, clip_grad=self.optimizer.clip_grad, loss_scale=1.0)

    def applied_multiplier(self, measurement: Measurement) -> float:
        """``unscale_and_clip_grads`` divides by the loss scale as ``_update_scale`` left it: on a step the loss
        scale grows at (fp16), by the grown one, so the gradient applied is the unscaled one times the old over
        the new scale, and the clip coefficient is that of the norm so reduced."""
        gradient_scale = measurement.gradient_scale
        return gradient_scale / zero_unscale_divisor(measurement.action.global_norm * gradient_scale,
                                                     clip_grad=self.optimizer.clip_grad,
                                                     loss_scale=self.optimizer.loss_scale,
                                                     zeroes_invalid_norm=False)

    def skip_optimizer_step(self) -> None:
        """``_update_scale``'s caller tests ``self.overflow`` right after it: set, the step goes DeepSpeed's own
        overflow path (gradients dropped, no parameter or moment change, the engine counts a skipped step and
        does not step the learning-rate schedule); the loss scaler itself saw no overflow."""
        self.optimizer.overflow = self.skipping = True

    def end_skip(self) -> None:
        """Some releases (master) set ``overflow`` at each step only where they check for one (fp16): left set,
        it would skip every later step."""
        if self.skipping:
            self.optimizer.overflow = self.skipping = False

    def observe_skipped(self, measurement: Measurement, index: int, slices: PartitionSlices) -> None:
        """Fold in partition ``index``'s gradient on a skipped step, wherever the family holds it then."""
        raise NotImplementedError


def observe_chunks(measurement: Measurement, index: int, slices: PartitionSlices,
                   chunks: Sequence[torch.Tensor]) -> None:
    """Fold in a partition still held as per-parameter pieces laid end to end: no copy of it."""
    measurement.observe(index, *slices.chunked_views(chunks))


def param_group_of(partitions: Sequence[torch.Tensor], flat_grad: torch.Tensor) -> int:
    """The index of the parameter group whose flat fp32 partition has ``flat_grad`` as its gradient."""
    for index, partition in enumerate(partitions):
        if partition.grad is flat_grad:
            return index
    raise RuntimeError("layer_grad_norms: the optimizer unscaled a gradient of no known parameter group")
