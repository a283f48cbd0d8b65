# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What the opt-in remedies do to one optimizer step (``Remedies.decide``), from the step's reduced table.

``adaptive_clipping`` (``adaptive_clipping.py``) and ``skip_step`` (``skip_step.py``) act on the optimizer step, so
the step they act on is measured and reduced before the optimizer steps (the adapter's ``act``), with the same two
all-reduces as any measured step and nothing more. The decision (``Action``) is taken from that reduced table and
the reported loss, both the same on every rank, so every rank skips or scales alike; it then travels with the
step's scales (``result.StepScales``) into the result: ``skipped`` and ``skip_reason``, ``adaptive_clip``. Once the
optimizer has applied the step (``Remedies.applied``), what it applied joins the adaptive averages.

Every row of the statistics table is a bucket here, the unreported row of the parameters a ``group_by`` pattern
leaves out included (key ``UNMATCHED``): their gradient is clipped by its own average, as any bucket's.
"""

import logging
import math
import os
from dataclasses import dataclass
from typing import Callable, Hashable, List, Optional, Sequence, Tuple, Union

import torch

from ..config import LayerGradNormsConfig
from ..statistics.reduction import LossAgreement
from ..statistics.statistics import SUMSQ
from .adaptive_clipping import AdaptiveClipping
from .skip_step import SkipStep

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "layer_grad_norms"
"""The entry of the optimizer's state dict that holds the remedies' state."""
UNIVERSAL_STATE = os.path.join("zero", "optimizer_state.pt")
"""Where a universal checkpoint (``ds_to_universal``) keeps the optimizer state dict's unsharded entries, ours
among them: DeepSpeed copies every entry but the partitions' from the first rank's file."""
UNMATCHED = "(unmatched by group_by)"
"""The key of the adaptive average of the parameters a ``group_by`` pattern leaves out (the unreported row)."""


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


ClipDivisor = Callable[[float], float]
"""What DeepSpeed's global clipping divides the gradient by, for a global norm."""


class Remedies:
    """The remedies a ds_config turns on, for one optimizer's buckets."""

    def __init__(self,
                 config: LayerGradNormsConfig,
                 keys: Sequence[Hashable],
                 num_rows: int,
                 losses: Optional[LossAgreement] = None) -> None:
        """``keys``: the buckets, the first rows of a table of ``num_rows`` gradient rows (one more: ``UNMATCHED``);
        ``losses``: the adapter's, over which ``skip_step`` agrees the loss (one of its own by default)."""
        buckets = list(keys) + [UNMATCHED] * (num_rows - len(keys))
        self.adaptive = (AdaptiveClipping(config.adaptive_clipping, buckets)
                         if config.adaptive_clipping.enabled else None)
        self.skip = SkipStep(config.skip_step, losses) if config.skip_step.enabled else None
        self.num_buckets = num_rows
        self.pending: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        """The decided step's pre-clip norms and factors, until the optimizer has applied it (``applied``)."""
        self.restored = False
        """A checkpoint's state was loaded (``load_state_dict``), or the first step of a fresh run was taken."""

    @staticmethod
    def wanted(config: LayerGradNormsConfig,
               keys: Sequence[Hashable],
               num_rows: int,
               losses: Optional[LossAgreement] = None) -> Optional["Remedies"]:
        return Remedies(config, keys, num_rows, losses) if config.acts() else None

    def report_loss(self, loss: Union[float, torch.Tensor]) -> None:
        if self.skip is not None:
            self.skip.loss.report(loss)

    def decide(self, step: int, reduced: torch.Tensor, gradient_scale: float, clip_divisor: ClipDivisor) -> Action:
        """``step``'s action from its ``reduced`` table (host, the gradient's rows first), whose gradient carries
        ``gradient_scale``; ``clip_divisor(norm)``: what DeepSpeed's global clipping divides the gradient by for a
        global norm ``norm``. The adaptive averages move once the step is applied (``applied``)."""
        norms = reduced[:self.num_buckets, SUMSQ].sqrt() / gradient_scale
        global_norm = math.sqrt(reduced[:self.num_buckets, SUMSQ].sum().item()) / gradient_scale
        reason = self.skip.judge(step, global_norm) if self.skip is not None else None
        factors = None
        self.pending = None
        if self.adaptive is not None and reason is None and math.isfinite(global_norm):
            factors = self.adaptive.factors(norms, 1.0 / clip_divisor(global_norm))
            self.pending = (norms, factors if factors is not None else torch.ones_like(norms))
        return Action(reason,
                      None if factors is None else tuple(factors.tolist()),
                      global_norm,
                      adaptive=self.adaptive is not None,
                      skipping=self.skip is not None)

    def applied(self, multiplier: float) -> None:
        """The optimizer applied the step ``decide`` decided last, its gradient multiplied, besides each bucket's
        factor, by ``multiplier`` (the global clip coefficient in the warm-up; where ZeRO unscales an fp16 step by
        the loss scale it grew to, old over new scale): each bucket's average takes in the norm it applied."""
        if self.pending is not None:
            norms, factors = self.pending
            self.adaptive.update(norms * factors * multiplier)
            self.pending = None

    def overflowed(self) -> Action:
        """The action of a step the loss scaler skips: none; the loss reported for it is dropped, not judged with
        the next step's norm."""
        self.pending = None
        if self.skip is not None:
            self.skip.loss.drop()
        return Action(adaptive=self.adaptive is not None, skipping=self.skip is not None)

    def active(self) -> List[Tuple[str, Union[AdaptiveClipping, SkipStep]]]:
        """The remedies on, by their ds_config key."""
        return [(name, remedy) for name, remedy in (("adaptive_clipping", self.adaptive), ("skip_step", self.skip))
                if remedy is not None]

    def state_dict(self) -> dict:
        """Each remedy's state, by its ds_config key: adaptive clipping's averages, skip_step's windows."""
        return {name: remedy.state_dict() for name, remedy in self.active()}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s state; a remedy the checkpoint lacks starts afresh, named in a warning."""
        self.restored = True
        missing = [name for name, remedy in self.active() if name not in state]
        for name, remedy in self.active():
            if name in state:
                remedy.load_state_dict(state[name])
        if missing:
            logger.warning("layer_grad_norms: the checkpoint holds no state of %s; %s", ", ".join(missing),
                           self.restarting(missing))

    def first_step(self, step: int) -> None:
        """The first step this process takes: a run resumed (``step`` > 1) without ``load_state_dict`` restarts
        every remedy, said in a warning (``load_checkpoint(load_optimizer_states=False)`` or
        ``load_module_only=True`` read no optimizer state)."""
        if not self.restored and step > 1:
            logger.warning(
                "layer_grad_norms: resumed at step %d without the remedies' state (load_checkpoint with "
                "load_optimizer_states=False or load_module_only=True reads none); %s", step,
                self.restarting([name for name, _ in self.active()]))
        self.restored = True

    def restarting(self, names: Sequence[str]) -> str:
        """What restarts for the remedies ``names``, in words."""
        said = []
        if "adaptive_clipping" in names:
            said.append(f"adaptive_clipping's averages restart their warm-up ({self.adaptive.warmup_steps} steps of "
                        "global clipping)")
        if "skip_step" in names:
            said.append(f"skip_step's windows restart empty (no step is judged for {self.skip.least} steps)")
        return "; ".join(said)


def saved_state(state_dict_list, checkpoint_folder: Optional[str]) -> Optional[dict]:
    """The remedies' state a checkpoint holds, or ``None``: from the optimizer state dicts of every rank's ZeRO file
    (the same in each; the first that has it), or from a universal checkpoint's ``UNIVERSAL_STATE``, where DeepSpeed
    passes ``checkpoint_folder`` and no state dicts."""
    if checkpoint_folder:
        path = os.path.join(checkpoint_folder, UNIVERSAL_STATE)
        states = [torch.load(path, map_location="cpu", weights_only=False)] if os.path.isfile(path) else []
    else:
        states = state_dict_list if isinstance(state_dict_list, (list, tuple)) else [state_dict_list]
    return next((state[CHECKPOINT_KEY] for state in states if state and CHECKPOINT_KEY in state), None)


def scale_spans(flat: torch.Tensor, spans: Sequence[Tuple[int, int, float]]) -> None:
    """Multiply each span ``(start, length, factor)`` of a flat gradient, in place; spans of factor 1 are left alone.
    One multiply per span, and spans are whole buckets where the layout keeps a bucket's parameters together."""
    for start, length, factor in spans:
        if factor != 1.0:
            flat.narrow(0, start, length).mul_(factor)
