# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Adam's rule: which optimizers follow it, and what its step did to a parameter, derived from the state after it.

``optimizer_stats`` reads the update of a step without a copy of the weights taken before it: the update is
derived from the weights and moments after the step by the rule (``AdamRule``) of the parameter group that
stepped them. That is only right for an optimizer known to run that rule (``adam_decoupling``: known by the step
method it runs) and with the step count it applied (``step_counter``: FusedAdam keeps it in one parameter's state
per group). A module of its own: the rule is the mathematics of the Adam family, which ``adapters/refusals.py``
consults at initialize without reading any statistic.
"""

import inspect
import math
from dataclasses import dataclass
from typing import Callable, List

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")
"""Adam's state per parameter: the first and second moments."""
NEEDS_ADAM = ("update", ) + MOMENTS
"""The optimizer statistics that read Adam's state (the update is derived from it by the rule)."""


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
