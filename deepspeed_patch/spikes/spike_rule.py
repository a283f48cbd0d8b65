# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The spike trigger's rule (``SpikeTrigger``): when a step's global gradient norm, or the loss the training loop
reports, jumps above a factor of its running median, or the loss scaler skips steps in a row."""

import math
import statistics
from collections import deque
from typing import Any, Callable, Dict, Optional, Tuple

WARM_UP = 5
"""Global norms the trigger needs before it judges a spike (fewer if its window is shorter): a median of
one or two steps would fire on ordinary noise."""


class SpikeTrigger:
    """Fires when the global gradient norm jumps above ``norm_ratio`` (``grad_norm_factor``) times its running
    median over the last ``window`` steps, when the loss the training loop reports jumps above ``loss_ratio``
    (``loss_factor``) times its own running median, or (``on_overflow``) when the loss scaler has skipped
    ``overflow_steps`` steps in a row; and not again within ``cooldown`` steps of a fire.

    Routine dynamic loss scaling skips a step now and then (a scale grown until the gradient overflows, and the
    search for a scale at the start of a run), so an overflow fires only after ``overflow_steps`` skipped steps in
    a row, and a streak that begins at step 1 never does; a resumed run restores its scale, so its skipped steps
    count from the first. A non-finite norm on a step the scaler did not skip fires at once. After a fire at step
    F the next comes at ``F + cooldown`` at the earliest: a sustained spike, which the lagging median sees on every
    step, fires once. The windows live in memory and start empty at every start, a resume included (keeping them
    would need call sites in the engine's checkpoint methods); a median is judged once its window holds
    ``min(window, WARM_UP)`` values, and until then only an overflow fires.
    """

    def __init__(self,
                 norm_ratio: Optional[float],
                 window: int,
                 capture_steps: int,
                 on_overflow: bool,
                 loss_ratio: Optional[float] = None,
                 cooldown: int = 1,
                 overflow_steps: int = 1) -> None:
        self.norm_ratio, self.capture_steps, self.on_overflow = norm_ratio, capture_steps, on_overflow
        self.loss_ratio = loss_ratio
        self.cooldown, self.overflow_steps = cooldown, overflow_steps
        self.recent: deque = deque(maxlen=window)
        self.recent_losses: deque = deque(maxlen=window)
        self.last_fire: Optional[int] = None
        self.skipped_since: Optional[int] = None
        """The first step of the current streak of skipped steps, or ``None``."""

    def update(self,
               step: int,
               global_norm: Optional[float],
               overflow: bool,
               loss: Optional[float] = None) -> Optional[Dict[str, Any]]:
        """Feed one optimizer step; returns what fired, or ``None``.

        ``global_norm`` is ``None`` when the optimizer computed none (``compute_grad_norm: false``); a
        non-finite one on a step the loss scaler did not skip (bf16, fp32: no scaler handles it) fires at
        once, even in the warm-up. ``loss``: the loss reported since the last step, or ``None``; it is
        watched only with a ``loss_ratio``.
        """
        if overflow:
            reason = "overflow" if self._overflow_fires(step) else None
        else:
            self.skipped_since = None
            reason = _spike("grad norm", global_norm, self.norm_ratio, self.recent)
            if self.loss_ratio is not None:
                reason = _spike("loss", loss, self.loss_ratio, self.recent_losses) or reason
        if reason is None or (self.last_fire is not None and step - self.last_fire < self.cooldown):
            return None
        self.last_fire = step
        return {"fired_at": step, "reason": reason, "capture_until": step + self.capture_steps}

    def _overflow_fires(self, step: int) -> bool:
        """Count one more skipped step; whether the streak of them fires."""
        if self.skipped_since is None:
            self.skipped_since = step
        searching = self.skipped_since == 1
        return self.on_overflow and not searching and step - self.skipped_since + 1 >= self.overflow_steps


def judge_outlier(name: str, value: Optional[float], recent: deque, least: int,
                  bound: Callable[[deque], Tuple[float, str]]) -> Optional[str]:
    """Why ``value`` is an outlier, or ``None``: the rule of the spike trigger and of ``skip_step``, which differ in
    ``bound(recent)`` alone (the limit and how to say it), judged once ``recent`` holds ``least`` values. ``value``
    then joins ``recent``; ``None`` is skipped; a non-finite value is an outlier at once and stays out."""
    if value is None:
        return None
    if not math.isfinite(value):
        return f"{name} {value}"
    limit, said = bound(recent) if len(recent) >= least else (math.inf, "")
    recent.append(value)
    return f"{name} {value:.4g} > {said}" if value > limit else None


def _spike(name: str, value: Optional[float], ratio: float, recent: deque) -> Optional[str]:
    """Why ``value`` is a spike above ``ratio`` times the median of ``recent`` (judged after the warm-up)."""

    def times_median(values: deque) -> Tuple[float, str]:
        median = statistics.median(values)
        return ratio * median, f"{ratio} x median {median:.4g}"

    return judge_outlier(name, value, recent, min(recent.maxlen, WARM_UP), times_median)
