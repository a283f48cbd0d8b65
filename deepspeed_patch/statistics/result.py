# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A step's result: the dict ``get_layer_grad_norms()`` returns, made from the step's reduced table and its scales
(``StepScales``), the table brought to the host with the optimizer's global norm in one copy (``host_copy``).
"""

import math
from dataclasses import dataclass, replace
from typing import Callable, Hashable, List, Optional, Sequence, Tuple

import torch

from ..outputs.tags import ADAPTIVE_CLIP, SKIPPED
from ..remedies.remedies import Action
from .clipping import torch_clip_divisor
from .statistics import NUMEL, SUMSQ, bucket_results, total_norm

NormFormula = Tuple[torch.Tensor, Callable[[float], float]]


@dataclass(frozen=True)
class StepScales:
    """One step's number, overflow and the factors its gradient carries and is divided by."""

    step: int
    overflow: bool
    gradient_scale: float
    """The loss scale the observed gradients carry."""
    applied_divisor: float
    """What the optimizer divides them by: loss scale and clipping together."""
    clip_norm: Optional[float]
    """Clipping as ``torch.nn.utils.clip_grad_norm_`` does it (the factor follows from the table)."""
    divisor_of_norm: Optional[NormFormula] = None
    """The applied divisor as ``formula(norm)`` of an optimizer's global norm still on its device, resolved by
    ``host_copy`` (then ``None``)."""
    clip_by_status: bool = False
    """``clip_norm`` applies to the norm whose square the status row carries, not to the table's total."""
    kinds: Tuple[str, ...] = ()
    """The optimizer statistics whose blocks of rows follow the gradient's in the table."""
    action: Optional[Action] = None
    """What the remedies did to the step (skipped it, or scaled each bucket), if any is on."""


def host_copy(reduced: torch.Tensor, scales: Sequence[StepScales]) -> Tuple[torch.Tensor, List[StepScales]]:
    """A reduced table on the host, and ``scales`` with the applied divisors of their global norms resolved:
    the norms travel in the same copy, the one host synchronisation of a measured step (or of a fire)."""
    norms = [entry.divisor_of_norm[0].reshape(1).to(reduced) for entry in scales if entry.divisor_of_norm is not None]
    host = torch.cat([reduced.flatten(), *norms]).cpu()
    values = iter(host[reduced.numel():].tolist())
    resolved = [
        entry if entry.divisor_of_norm is None else replace(
            entry, applied_divisor=float(entry.divisor_of_norm[1](next(values))), divisor_of_norm=None)
        for entry in scales
    ]
    return host[:reduced.numel()].view(reduced.shape), resolved


def resolve_scales(scales: Sequence[StepScales]) -> List[StepScales]:
    """``scales`` with the applied divisors of their global norms resolved, for a table already on the host."""
    return host_copy(torch.zeros(0, dtype=torch.float64), scales)[1]


def step_result(stats: torch.Tensor, scales: StepScales, keys: Sequence[Hashable], selected: Sequence[Hashable],
                extra: Sequence[str]) -> Optional[dict]:
    """The result dict of one step from its reduced table (status row last, on the host) and its resolved
    scales: ``step``, ``overflow``, ``clip_coef``, ``pre_clip`` and ``post_clip`` of the ``selected``
    buckets, and one key per optimizer statistic (``scales.kinds``), unscaled; ``None`` when the status row
    says a rank failed to measure the step."""
    if stats[-1, NUMEL] > 0:
        return None
    blocks = stats[:-1].view(1 + len(scales.kinds), -1, stats.shape[1])
    gradient = blocks[0]
    applied_divisor = scales.applied_divisor
    if scales.clip_norm:
        norm = math.sqrt(stats[-1, SUMSQ]) if scales.clip_by_status else total_norm(gradient)
        applied_divisor = torch_clip_divisor(norm, scales.clip_norm)
    action = scales.action or Action()
    pre_clip = bucket_results(gradient, keys, selected, 1.0 / scales.gradient_scale, extra)
    clip_coef = post_clip = None
    if not (scales.overflow or action.skipped):
        clip_coef = scales.gradient_scale / applied_divisor
        post_clip = bucket_results(gradient, keys, selected, 1.0 / applied_divisor, extra, action.factors)
    result = {
        "step": scales.step,
        "overflow": scales.overflow,
        "clip_coef": clip_coef,
        "pre_clip": pre_clip,
        "post_clip": post_clip
    }
    result.update(remedy_fields(action, keys, selected))
    result.update(
        (kind, bucket_results(block, keys, selected, 1.0, extra)) for kind, block in zip(scales.kinds, blocks[1:]))
    return result


def remedy_fields(action: Action, keys: Sequence[Hashable], selected: Sequence[Hashable]) -> dict:
    """The result's fields of the remedies that are on: ``skipped`` and ``skip_reason`` (``skip_step``), and
    ``adaptive_clip``, each selected bucket's factor (1.0: not clipped; ``None`` in the warm-up, on a skipped or
    overflowed step: global clipping applied, or nothing)."""
    fields = {}
    if action.skipping:
        fields.update({SKIPPED: action.skipped, "skip_reason": action.skip_reason})
    if action.adaptive:
        factors = None
        if action.factors is not None:
            position = {key: index for index, key in enumerate(keys)}
            factors = {key: action.factors[position[key]] for key in selected}
        fields[ADAPTIVE_CLIP] = factors
    return fields
