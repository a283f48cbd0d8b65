# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Whether to skip a spiking optimizer step: OLMo-core's ``SkipStepOptimizer`` rule.

A step is skipped when its loss, or its global gradient norm, lies more than ``sigma`` standard deviations
(unbiased, as ``torch.std``) above the mean of the previous ``window`` values. Every step's value joins its
window, a skipped step's included (as in OLMo-core); values are judged once the window holds
``min(window, max(20, window // 2))`` of them. Two deliberate differences from OLMo-core: only a value *above*
the mean counts (OLMo-core takes the absolute deviation, so a sudden drop of the loss is skipped as well), and
a window of identical values skips any larger value instead of every value (OLMo-core divides by a zero standard
deviation). A non-finite loss or norm on a step the loss scaler did not skip is skipped at once and stays out
of its window.

Its inputs are the same on every rank: the global norm from the step's reduced table, and the largest loss any
rank of the process group reported for the step (``reduction.LossAgreement``: one MAX all-reduce per step over the
group the step is reduced over, made whether or not a loss was reported, which agrees the trigger's loss too where
it watches one), so every rank takes the same decision even where the ranks report their own losses.

Both windows are in the checkpoint (``state_dict``), as OLMo-core keeps its own: a resumed run judges from its
first step.
"""

import statistics
from collections import deque
from typing import Optional, Tuple

from ..config import SkipStepConfig
from ..spikes.spike_rule import judge_outlier
from ..statistics.reduction import LossAgreement, reported_loss

MIN_JUDGED = 20
"""OLMo-core's least number of values before any is judged (or half the window, if larger)."""


class SkipStep:
    """The windows of the loss and of the global norm, and the decision of each step."""

    def __init__(self, config: SkipStepConfig, losses: Optional[LossAgreement] = None) -> None:
        """``losses``: the adapter's, over which the loss is agreed (one of its own, for one process, by default)."""
        self.sigma = config.sigma
        self.least = min(config.window, max(MIN_JUDGED, config.window // 2))
        self.losses: deque = deque(maxlen=config.window)
        self.norms: deque = deque(maxlen=config.window)
        self.loss = (losses or LossAgreement()).reader()
        """The loss reported for the step about to be taken, judged with its global norm."""

    def judge(self, step: int, global_norm: float) -> Optional[str]:
        """Why ``step``, whose global gradient norm is ``global_norm``, is skipped, or ``None``; the loss reported
        since the last step (if any) is judged with it."""
        loss = reported_loss(self.loss.agree(step))
        reasons = [
            reason for reason in (self._outlier("loss", loss, self.losses),
                                  self._outlier("grad norm", global_norm, self.norms)) if reason
        ]
        return "; ".join(reasons) or None

    def state_dict(self) -> dict:
        """The state a checkpoint keeps: both windows, oldest value first."""
        return {"losses": list(self.losses), "norms": list(self.norms)}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s windows (their newest ``window`` values, where the window shrank)."""
        self.losses.clear()
        self.losses.extend(state["losses"])
        self.norms.clear()
        self.norms.extend(state["norms"])

    def _outlier(self, name: str, value: Optional[float], window: deque) -> Optional[str]:
        """Why ``value`` lies above ``sigma`` standard deviations over the mean of ``window``, or ``None``."""

        def above_mean(values: deque) -> Tuple[float, str]:
            mean, std = statistics.fmean(values), statistics.stdev(values)
            return mean + self.sigma * std, f"mean {mean:.4g} + {self.sigma:g} x std {std:.4g}"

        return judge_outlier(name, value, window, self.least, above_mean)
