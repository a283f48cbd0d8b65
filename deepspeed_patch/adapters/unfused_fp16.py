# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``FP16_UnfusedOptimizer``: fp16 or bf16 without ZeRO, with a torch optimizer.

Every rank holds the whole gradient, as per-parameter fp32 copies read where the optimizer unscales and
clips them; the factor it divides by is its return value. On a skipped step the fp16 gradients are read
in ``_update_scale``, before they are dropped (their fp32 copies may not exist yet).

Like ``FP16_Optimizer``'s, these gradients carry no loss scale since DeepSpeed 0.18 (see ``fused_fp16``).
"""

from typing import List, Tuple

import torch

from ..optimizer_state.optimizer_stats import parameter_statistics
from .base import Setup
from .fused_fp16 import grad_or_zeros
from .optimizer import OptimizerAdapter


class UnfusedFP16Adapter(OptimizerAdapter):
    """Reads ``FP16_UnfusedOptimizer``'s per-parameter gradients."""

    def __init__(self, optimizer, setup: Setup) -> None:
        device = optimizer.fp16_groups[0][0].device
        self.members: List[Tuple[List[int], torch.Tensor]] = []
        """Per parameter group: the positions of its measured parameters, and their buckets."""
        for params in optimizer.fp16_groups:
            measured = [index for index, param in enumerate(params) if setup.bucket_of(param) is not None]
            buckets = [setup.bucket_of(params[index]) for index in measured]
            self.members.append((measured, torch.tensor(buckets, dtype=torch.int64, device=device)))
        super().__init__(optimizer, setup, len(self.members), device)
        # the inner optimizer steps the fp32 copies, in the order of the fp16 parameters
        buckets = [[setup.bucket_of(param) for param in params] for params in optimizer.fp16_groups]
        self.optimizer_statistics = parameter_statistics(optimizer.optimizer, buckets, self.kinds)

    @staticmethod
    def handles(optimizer) -> bool:
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

        return isinstance(optimizer, FP16_UnfusedOptimizer) and not optimizer.fused_lamb_legacy

    @staticmethod
    def trainable_params(optimizer) -> List[torch.nn.Parameter]:
        return [param for params in optimizer.fp16_groups for param in params]

    def unscale_and_clip_grads(self, total_norm, apply_scale=True) -> None:
        """Top of ``unscale_and_clip_grads``: the fp32 gradient copies."""
        if self.measurement is not None and apply_scale:
            self._observe(self.optimizer.fp32_groups)

    def update_scale(self, skip) -> None:
        """Top of ``_update_scale``: the loss scale the gradients carry, and on a skipped step the fp16
        gradients, before they are dropped."""
        if self.measurement is not None and self.capabilities.fp16_loss_scaled_by_optimizer:
            self.measurement.set_gradient_scale(self.optimizer.cur_scale)
        if self.measurement is not None and skip:
            self._observe(self.optimizer.fp16_groups)

    def _observe(self, groups: List[List[torch.nn.Parameter]]) -> None:
        """Fold in the gradients of ``groups`` (the fp16 parameters, or their fp32 copies)."""
        measurement = self.measurement
        with measurement.guarded("reading the gradients"):
            for index, (params, (measured, buckets)) in enumerate(zip(groups, self.members)):
                measurement.observe(index, [grad_or_zeros(params[position]) for position in measured], buckets)
