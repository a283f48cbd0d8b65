# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``FP16_Optimizer``: fp16 or bf16 without ZeRO, with DeepSpeed's ``FusedAdam``.

Every rank holds each parameter group's whole gradient as one flat fp32 buffer, read where the
optimizer unscales and clips it, all parameter groups at once; the factor it divides by is its return value. On a
skipped step the gradient is read before it is dropped, in whichever method of the release drops it
(``capabilities.Capabilities.fp16_skip_method``).

Whether the gradients carry the loss scale depends on the release
(``Capabilities.fp16_loss_scaled_by_optimizer``); where they do not, ``unscale_and_clip_grads`` still
divides by it, and ``post_clip`` and ``clip_coef`` show what it really applies
(``upstream/bug_reports/stage0_unscaled_loss.md``).
"""

from typing import List

import torch

from ..optimizer_state.optimizer_stats import optimizer_statistics
from ..statistics.partition_slices import back_to_back_ranges, partition_spans
from ..statistics.partition_stats import prepare_partition
from .base import Setup
from .optimizer import OptimizerAdapter, observe_chunks, param_group_of


class FusedFP16Adapter(OptimizerAdapter):
    """Reads ``FP16_Optimizer``'s flat fp32 gradients."""

    def __init__(self, optimizer, setup: Setup) -> None:
        device = optimizer.fp32_groups_flat[0].device
        self.partition_slices = [
            prepare_partition(partition_spans(back_to_back_ranges(params, setup.bucket_of), 0, flat.numel()), device)
            for params, flat in zip(optimizer.fp16_groups, optimizer.fp32_groups_flat)
        ]
        super().__init__(optimizer, setup, len(self.partition_slices), device)
        self.optimizer_statistics = optimizer_statistics(optimizer.optimizer, optimizer.fp32_groups_flat,
                                                         self.partition_slices, self.kinds)

    @staticmethod
    def handles(optimizer) -> bool:
        from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer

        return isinstance(optimizer, FP16_Optimizer) and not optimizer.fused_adam_legacy

    @staticmethod
    def trainable_params(optimizer) -> List[torch.nn.Parameter]:
        return [param for params in optimizer.fp16_groups for param in params]

    def unscale_and_clip_grads(self, grad_groups_flat, total_norm, apply_scale=True) -> None:
        """Top of ``unscale_and_clip_grads``: the flat fp32 gradients of all parameter groups."""
        measurement = self.measurement
        if measurement is None or not apply_scale:
            return
        with measurement.guarded("reading the fp32 gradients"):
            for flat_grad in grad_groups_flat:
                index = param_group_of(self.optimizer.fp32_groups_flat, flat_grad)
                measurement.observe_partition(index, flat_grad, self.partition_slices[index])

    def skip_step(self) -> None:
        """Top of ``_skip_invalid_grad_norm`` (where the release has it): a skipped step's gradients, before
        they are dropped."""
        measurement = self.measurement
        if measurement is not None:
            with measurement.guarded("reading a skipped step's gradients"):
                self._observe_skipped(measurement)

    def update_scale(self, skip) -> None:
        """Top of ``_update_scale`` (releases without ``_skip_invalid_grad_norm``): the loss scale the gradients
        carry, and on a skipped step its gradients, before they are dropped."""
        measurement = self.measurement
        if measurement is not None:
            with measurement.guarded("reading a skipped step's gradients"):
                if self.capabilities.fp16_loss_scaled_by_optimizer:
                    measurement.set_gradient_scale(self.optimizer.cur_scale)
                if skip:
                    self._observe_skipped(measurement)

    def _observe_skipped(self, measurement) -> None:
        """The fp16 gradients on an fp16 overflow, their flat fp32 copies on a non-finite norm."""
        for index, params in enumerate(self.optimizer.fp16_groups):
            flat_grad = self.optimizer.fp32_groups_flat[index].grad
            if flat_grad is not None:
                measurement.observe_partition(index, flat_grad, self.partition_slices[index])
            else:
                observe_chunks(measurement, index, self.partition_slices[index],
                               [grad_or_zeros(param) for param in params])


def grad_or_zeros(param: torch.nn.Parameter) -> torch.Tensor:
    """A parameter's gradient as one span, or zeros where it has none (a broadcast view: no allocation)."""
    if param.grad is None:
        return param.new_zeros(()).expand(param.numel())
    return param.grad.reshape(-1)
