"""The per-optimizer state: layer map, partition slices, interval, and the last measurement.

The optimizer's ``step()`` drives it:

- ``begin_step()`` once at the top; it decides whether this step is measured.
- ``observe(group_index, flat_grad)`` once per parameter group, on the flat gradient partition
  before clipping (still multiplied by the loss scale, if any).
- ``set_gradient_scale(scale)``: the loss scale the gradients carry (1 without fp16).
- ``set_applied_scale(divisor)``: what the optimizer divides the gradient by, loss scale and
  clipping together; not called on a step the loss scaler skips.
- ``end_step(overflow)`` once at the end: one collective, then the result dict.

Unmeasured steps cost one modulo and a few attribute reads.
"""

import logging
from typing import Callable, Dict, Hashable, List, Optional

import torch

from .config import LayerGradNormsConfig
from .layer_map import LayerMap
from .partition_slices import PartitionSlices
from .statistics import accumulate_runs, bucket_results, empty_stats, reduce_stats

logger = logging.getLogger(__name__)


class LayerGradNormTracker:
    """Per-layer gradient statistics for one ZeRO-1/2 optimizer."""

    def __init__(self, config: LayerGradNormsConfig, layer_map: LayerMap, slices: List[PartitionSlices],
                 group, device, completed_steps: Callable[[], int]) -> None:
        """``group``: the ranks to combine over; ``completed_steps()``: the engine's optimizer steps so far
        (restored from a checkpoint), so that ``step`` and the interval follow the training iteration."""
        self.interval = config.interval
        self.extra = config.statistics
        self.layer_map = layer_map
        self.selected = layer_map.select(config.layers)
        self.slices = slices
        self.group = group
        self.device = device
        self.completed_steps = completed_steps
        self.step = 0
        self.measuring = False
        self.result: Optional[dict] = None
        self._stats: Optional[torch.Tensor] = None
        self._observed = set()
        self._gradient_scale = 1.0
        self._applied_scale = 1.0

    def begin_step(self) -> bool:
        """Number this optimizer step; measure it if it falls on the interval."""
        self.step = self.completed_steps() + 1
        self.measuring = self.step % self.interval == 0
        if self.measuring:
            self._stats = empty_stats(len(self.layer_map.keys), self.device)
            self._observed = set()
            self._gradient_scale = self._applied_scale = 1.0
        return self.measuring

    def observe(self, group_index: int, flat_grad: torch.Tensor) -> None:
        """Fold one group's flat gradient partition in (once per group and step)."""
        if not self.measuring or group_index in self._observed:
            return
        slices = self.slices[group_index]
        accumulate_runs(self._stats, slices.views(flat_grad), slices.buckets, self.extra)
        self._observed.add(group_index)

    def set_gradient_scale(self, loss_scale: float) -> None:
        """The loss scale this step's gradients carry; the pre-clip statistics are divided by it."""
        self._gradient_scale = float(loss_scale)

    def set_applied_scale(self, divisor: float) -> None:
        """What the optimizer divides the observed gradient by: loss scale times clip factor."""
        self._applied_scale = float(divisor)

    def end_step(self, overflow: bool) -> None:
        """Reduce this step's statistics across data-parallel ranks and publish them.

        ``overflow``: the loss scaler skipped the step; pre-clip statistics only.
        """
        if not self.measuring:
            return
        self.measuring = False
        if len(self._observed) != len(self.slices):
            logger.warning("layer_grad_norms: step %d saw %d of %d parameter groups; not reported", self.step,
                           len(self._observed), len(self.slices))
            return
        stats = reduce_stats(self._stats, self.group)
        self._stats = None
        keys = self.layer_map.keys
        pre_clip = bucket_results(stats, keys, self.selected, 1.0 / self._gradient_scale, self.extra)
        clip_coef = post_clip = None
        if not overflow:
            clip_coef = self._gradient_scale / self._applied_scale
            post_clip = bucket_results(stats, keys, self.selected, 1.0 / self._applied_scale, self.extra)
        self.result = {
            "step": self.step,
            "overflow": bool(overflow),
            "clip_coef": clip_coef,
            "pre_clip": pre_clip,
            "post_clip": post_clip,
        }

    def get(self) -> Optional[Dict[Hashable, object]]:
        """The last measurement, or ``None`` before the first measured step."""
        return self.result
