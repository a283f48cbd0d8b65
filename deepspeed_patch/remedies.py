# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What the opt-in remedies do to one optimizer step (``Remedies.decide``), from the step's reduced table.

``adaptive_clipping`` (``adaptive_clipping.py``) and ``skip_step`` (``skip_step.py``) act on the optimizer step, so
the step they act on is measured and reduced before the optimizer steps (the adapter's ``act``), with the same two
all-reduces as any measured step and nothing more. The decision (``Action``) is taken from that reduced table and
the reported loss, both the same on every rank, so every rank skips or scales alike; it then travels with the
step's scales (``result.StepScales``) into the result: ``skipped`` and ``skip_reason``, ``adaptive_clip``.
"""

import math
from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Sequence, Tuple, Union

import torch

from .adaptive_clipping import AdaptiveClipping
from .config import LayerGradNormsConfig
from .skip_step import SkipStep
from .statistics import SUMSQ

CHECKPOINT_KEY = "layer_grad_norms"
"""The entry of the optimizer's state dict that holds the remedies' state."""


@dataclass(frozen=True)
class Action:
    """What the remedies do to one step."""

    skip_reason: Optional[str] = None
    """Why the step is skipped, or ``None``: it is applied."""
    factors: Optional[Tuple[float, ...]] = None
    """Each bucket's multiplier (rows of the table), where adaptive clipping replaces global clipping."""
    global_norm: float = math.nan
    """The step's global gradient norm, unscaled, from the reduced table."""
    adaptive: bool = False
    """``adaptive_clipping`` is on (the result carries ``adaptive_clip``)."""
    skipping: bool = False
    """``skip_step`` is on (the result carries ``skipped`` and ``skip_reason``)."""

    @property
    def skipped(self) -> bool:
        return self.skip_reason is not None


class Remedies:
    """The remedies a ds_config turns on, for one optimizer's buckets."""

    def __init__(self, config: LayerGradNormsConfig, keys: Sequence[Hashable]) -> None:
        self.adaptive = AdaptiveClipping(config.adaptive_clipping, keys) if config.adaptive_clipping.enabled else None
        self.skip = SkipStep(config.skip_step) if config.skip_step.enabled else None
        self.num_buckets = len(keys)

    @staticmethod
    def wanted(config: LayerGradNormsConfig, keys: Sequence[Hashable]) -> Optional["Remedies"]:
        return Remedies(config, keys) if config.acts() else None

    def report_loss(self, loss: Union[float, torch.Tensor]) -> None:
        if self.skip is not None:
            self.skip.report_loss(loss)

    def decide(self, reduced: torch.Tensor, gradient_scale: float, clip_divisor: Callable[[float], float]) -> Action:
        """The step's action from its ``reduced`` table (host, the gradient's rows first), whose gradient carries
        ``gradient_scale``; ``clip_divisor(norm)``: what DeepSpeed's global clipping divides the gradient by for a
        global norm ``norm``. An applied step's clipped norms join the adaptive averages here."""
        norms = reduced[:self.num_buckets, SUMSQ].sqrt() / gradient_scale
        global_norm = math.sqrt(reduced[:self.num_buckets, SUMSQ].sum().item()) / gradient_scale
        reason = self.skip.judge(global_norm) if self.skip is not None else None
        factors = None
        if self.adaptive is not None and reason is None and math.isfinite(global_norm):
            factors = self.adaptive.factors(norms)
            applied = factors if factors is not None else 1.0 / clip_divisor(global_norm)
            self.adaptive.update(norms * applied)
        return Action(reason,
                      None if factors is None else tuple(factors.tolist()),
                      global_norm,
                      adaptive=self.adaptive is not None,
                      skipping=self.skip is not None)

    def overflowed(self) -> Action:
        """The action of a step the loss scaler skips: none; the loss reported for it is dropped, not judged with
        the next step's norm."""
        if self.skip is not None:
            self.skip.loss = None
        return Action(adaptive=self.adaptive is not None, skipping=self.skip is not None)

    def state_dict(self) -> dict:
        return {"adaptive_clipping": self.adaptive.state_dict()} if self.adaptive is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.adaptive is not None and "adaptive_clipping" in state:
            self.adaptive.load_state_dict(state["adaptive_clipping"])


def scale_spans(flat: torch.Tensor, starts: Sequence[int], lengths: Sequence[int], buckets: Sequence[int],
                factors: Sequence[float]) -> None:
    """Multiply each span of a flat gradient partition by its bucket's factor, in place; spans of factor 1 are left
    alone. One multiply per span, and spans are whole buckets where the layout keeps a bucket's parameters together."""
    for start, length, bucket in zip(starts, lengths, buckets):
        factor = factors[bucket]
        if factor != 1.0:
            flat.narrow(0, start, length).mul_(factor)
