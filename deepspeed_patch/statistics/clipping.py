# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What the optimizers divide the gradient by when they unscale and clip it: the three formulas in use.

The post-clip statistics are the pre-clip ones divided by this one factor, so each formula mirrors its
optimizer exactly, rounding constant included. Where a formula differs between DeepSpeed releases the
caller passes the ``capabilities.Capabilities`` fact that decides it.
"""

import math
from typing import Iterable, Optional

import torch

EPSILON = 1e-6
"""Added to the global norm before dividing, by torch and by every DeepSpeed optimizer."""


def torch_clip_divisor(total_norm: float, max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` (and DeepSpeed's ``clip_grad_norm_`` without ZeRO): the gradient is
    multiplied by ``min(1, max_norm / (total_norm + eps))``; ``max_norm`` 0 means no clipping."""
    if max_norm <= 0.0:
        return 1.0
    return 1.0 / min(1.0, max_norm / (total_norm + EPSILON))


def bf16_clip_divisor(total_norm: float, clip_grad: float) -> float:
    """``BF16_Optimizer``: 1, or the inverse of its clip coefficient."""
    if clip_grad <= 0.0:
        return 1.0
    clip_coef = clip_grad / (float(total_norm) + EPSILON)
    return 1.0 / clip_coef if clip_coef < 1 else 1.0


def zero_unscale_divisor(scaled_total_norm: Optional[float],
                         clip_grad: float,
                         loss_scale: float,
                         zeroes_invalid_norm: bool = True) -> float:
    """ZeRO-1/2's ``unscale_and_clip_grads``: loss scale times clip factor, for a global norm (times the loss
    scale) of ``scaled_total_norm``; ``inf`` for an invalid norm where the release zeroes the gradient then
    (``Capabilities.zero_zeroes_invalid_norm``). Mirrors DeepSpeed, including its use of the loss scale as
    already updated for the next step."""
    if clip_grad <= 0.0 or scaled_total_norm is None:
        return loss_scale
    total_norm = float(scaled_total_norm)
    if zeroes_invalid_norm and (not math.isfinite(total_norm) or total_norm < 0):
        return math.inf
    return max(((total_norm / loss_scale) + EPSILON) / clip_grad, 1.0) * loss_scale


def engine_fp32_clip_square(parameters: Iterable[torch.nn.Parameter], mpu) -> torch.Tensor:
    """This rank's share of the squared global norm ``DeepSpeedEngine.clip_fp32_gradients`` clips by without
    ZeRO under an ``mpu`` (``runtime.utils.clip_grad_norm_``), left on the device: a gradient counts on
    model-parallel rank 0, or on every rank where its parameter is a model-parallel (tensor-sliced) one;
    summed over the model-parallel group (by the caller's reduction), it is the square of that norm. Under
    a pipeline that rank is the rank within the pipeline, so the norm leaves out the later stages' other
    parameters and counts a tied copy on the first stage: it is not the statistics' total norm, and the
    post-clip statistics must follow it. Nothing is written, nothing is communicated."""
    from deepspeed.runtime.utils import is_model_parallel_parameter

    on_rank_zero = mpu.get_model_parallel_rank() == 0
    squares = [  # the norm in fp32, as DeepSpeed's ``.float().norm(2)``, without an fp32 copy of a low-precision grad
        torch.linalg.vector_norm(param.grad.detach(), 2, dtype=torch.float32)**2 for param in parameters
        if param.grad is not None and (on_rank_zero or is_model_parallel_parameter(param))
    ]
    return torch.stack(squares).sum() if squares else torch.zeros(())
