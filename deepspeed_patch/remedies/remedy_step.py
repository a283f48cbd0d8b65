# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The remedies' part of one optimizer step (``RemedyStep``): reduce the step before the optimizer steps and decide
(``act``), have the optimizer skip it or lay the adaptive factors on each flat gradient while global clipping is
suspended (``scale``), and once the optimizer has applied it move the averages by what it applied (``end``). What
the optimizer is asked to do goes through its family's adapter (``OptimizerControl``).
"""

import dataclasses
import functools
import logging
from typing import List, Optional, Protocol, Sequence, Tuple

import torch

from ..outputs.process_rank import rank_of_process
from ..statistics.measurement import Measurement
from ..statistics.partition_slices import Span
from ..statistics.steps import FailureLatch
from .remedies import Action, Remedies, scale_spans

logger = logging.getLogger(__name__)


class OptimizerControl(Protocol):
    """What the remedy step asks of an optimizer family's adapter."""

    num_partitions: int

    def clip_divisor(self, global_norm: float) -> float:
        """What the optimizer's global clipping divides a gradient of unscaled norm ``global_norm`` by."""

    def applied_multiplier(self, measurement: Measurement) -> float:
        """What the optimizer multiplied the step's gradient by, unscaled and after the adaptive factors."""

    def spans_to_scale(self, index: int) -> Sequence[Span]:
        """The spans of flat gradient ``index`` of every parameter (a copy another rank counts included)."""

    def skip_optimizer_step(self) -> None:
        """Make the optimizer skip the step under way as it skips an overflowed one."""

    def end_skip(self) -> None:
        """Top of the step after a skipped one: the optimizer steps again."""

    def suspend_global_clipping(self) -> None:
        """No global clipping for the step under way (adaptive clipping replaces it)."""

    def resume_global_clipping(self) -> None:
        """Global clipping as it was before ``suspend_global_clipping``, if it was suspended."""


class RemedyStep:
    """``adaptive_clipping`` and ``skip_step`` acting on one optimizer's steps, the same on every rank."""

    def __init__(self, remedies: Remedies, optimizer: OptimizerControl, latch: FailureLatch,
                 process_group: object) -> None:
        self.remedies = remedies
        self.optimizer = optimizer
        self.latch = latch
        self.process_group = process_group
        self.scaling: Optional[List[List[Tuple[int, int, float]]]] = None
        """The step's adaptive factors laid on each partition's spans (``scaled_spans``), while they are to apply."""

    def begin(self, step: int) -> None:
        """Top of the optimizer step: the optimizer steps again after a skipped step; a resumed run without the
        remedies' state says what restarts."""
        self.optimizer.end_skip()
        self.remedies.first_step(step)

    def act(self, measurement: Measurement) -> None:
        """Before the optimizer steps, on a step the loss scaler does not skip, with every partition observed: reduce
        the step now (its only reduction) and let the remedies decide, from that table, the same on every rank.
        A skipped step then goes the way DeepSpeed skips an overflowed one (``skip_optimizer_step``); adaptive
        factors replace global clipping for the step (``suspend_global_clipping``) and are applied to each
        partition by the family's read point (``scale``). Should deciding fail, nothing is suspended and the step
        has no action: it is clipped globally, and no result claims factors."""
        step = measurement.step
        reduced = None
        with self.latch.failing_locally("reducing the step before the optimizer step", step):
            reduced = measurement.reduce_now(self.process_group)
        if reduced is None:  # a rank failed to measure: finish switches the statistics off on every rank
            return
        with self.latch.failing_locally("deciding the remedies", step):
            action = self.remedies.decide(step, reduced, measurement.gradient_scale, self.optimizer.clip_divisor)
            measurement.action, self.scaling = action, self._laid_on_spans(action)
            if action.skipped:
                if rank_of_process() == 0:  # the same decision on every rank: one line
                    logger.warning("layer_grad_norms: skip_step skips step %d (%s)", step, action.skip_reason)
                self.optimizer.skip_optimizer_step()
            elif self.scaling is not None:
                self.optimizer.suspend_global_clipping()

    def overflowed(self, measurement: Measurement) -> None:
        """The loss scaler skips the step: the remedies do nothing to it."""
        measurement.action = self.remedies.overflowed()

    def scale(self, measurement: Measurement, index: int, flat_grad: torch.Tensor) -> None:
        """Multiply flat gradient ``index`` (``scaled_spans``) by each bucket's adaptive factor, in place, where the
        step has them; before the optimizer divides it by the loss scale. Should that fail, global clipping is
        restored for the step, the result claims no factor (``drop_factors``) and the failure flags the step (the
        statistics switch off at the next reduction); the caller then records the divisor applied."""
        if self.scaling is None:
            return
        with measurement.guarded("scaling the gradient by the adaptive factors"):
            try:
                scale_spans(flat_grad, self.scaling[index])
            except Exception:
                self.drop_factors(measurement)
                raise

    def drop_factors(self, measurement: Measurement) -> None:
        """The step's adaptive factors are not (all) applied: global clipping is back for it, the result says so."""
        self.scaling = None
        self.optimizer.resume_global_clipping()
        if measurement.action is not None:
            measurement.action = dataclasses.replace(measurement.action, factors=None)

    def end(self, measurement: Optional[Measurement], overflow: bool) -> None:
        """End of the optimizer step: an applied step's adaptive averages take in what the optimizer applied
        (``applied_multiplier``, read before global clipping is restored)."""
        self.scaling = None
        action = measurement.action if measurement is not None else None
        if action is not None and not (action.skipped or overflow or measurement.failed):
            with self.latch.failing_locally("updating the adaptive averages", measurement.step):
                self.remedies.applied(self.optimizer.applied_multiplier(measurement))

    def restore_clipping(self) -> None:
        """After the optimizer step, whatever happened in it: global clipping as it was before ``act``."""
        self.optimizer.resume_global_clipping()

    def _laid_on_spans(self, action: Action) -> Optional[List[List[Tuple[int, int, float]]]]:
        if action.factors is None:
            return None
        return [[(start, length, action.factors[bucket]) for start, length, bucket in spans]
                for spans in self.scaled_spans]

    @functools.cached_property
    def scaled_spans(self) -> List[Sequence[Span]]:
        """Each flat gradient's spans that adaptive clipping multiplies (``spans_to_scale``)."""
        return [self.optimizer.spans_to_scale(index) for index in range(self.optimizer.num_partitions)]
