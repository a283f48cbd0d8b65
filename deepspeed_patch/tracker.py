"""The per-optimizer state: layer map, partition slices, interval, and the last measurement.

``DeepSpeedZeroOptimizer.step()`` drives it through four calls:

- ``begin_step()`` once at the top; it decides whether this step is measured.
- ``observe_loss_scale(scale, flat_grads)`` just before the loss scaler updates: the scale this
  step's gradients carry and, when the scaler skips the step, the gradients it is about to drop.
- ``observe_partition(group_index, flat_grad, ...)`` for each parameter group, on the flat fp32
  gradient partition just before ``unscale_and_clip_grads``, with what that call divides by.
- ``end_step()`` once at the end: one collective, then the result dict.

Unmeasured steps cost a counter increment and a few attribute reads.
"""

import logging
from typing import Dict, Hashable, List, Optional

import torch

from .config import LayerGradNormsConfig
from .layer_map import LayerMap
from .partition_slices import PartitionSlices
from .statistics import accumulate_runs, bucket_results, combined_scale, empty_stats, reduce_stats

logger = logging.getLogger(__name__)


class LayerGradNormTracker:
    """Per-layer gradient statistics for one ZeRO-1/2 optimizer."""

    def __init__(self, config: LayerGradNormsConfig, layer_map: LayerMap, slices: List[PartitionSlices],
                 dp_group, device) -> None:
        self.interval = config.interval
        self.layer_map = layer_map
        self.selected = layer_map.select(config.layers)
        self.slices = slices
        self.dp_group = dp_group
        self.device = device
        self.steps = 0
        self.measuring = False
        self.result: Optional[dict] = None
        self._stats: Optional[torch.Tensor] = None
        self._observed = set()
        self._gradient_scale = 1.0
        self._applied_scale = 1.0
        self._overflow = False

    def begin_step(self) -> bool:
        """Count the optimizer step; measure it if it falls on the interval."""
        self.steps += 1
        self.measuring = self.steps % self.interval == 0
        if self.measuring:
            self._stats = empty_stats(len(self.layer_map.keys), self.device)
            self._observed = set()
            self._overflow = False
            self._gradient_scale = self._applied_scale = 1.0
        return self.measuring

    def observe_loss_scale(self, loss_scale: float, overflow_grads: Optional[Dict[int, torch.Tensor]]) -> None:
        """Record the scale this step's gradients carry, before the scaler updates it.

        ``overflow_grads`` (group index to flat gradient partition) is given when the scaler is
        about to skip the step: those gradients are measured now, before they are dropped.
        """
        if not self.measuring:
            return
        self._gradient_scale = loss_scale
        if overflow_grads is None:
            return
        for group_index, flat_grad in overflow_grads.items():
            self._accumulate(group_index, flat_grad.float())
        self._overflow = True

    def observe_partition(self, group_index: int, flat_grad: torch.Tensor, scaled_total_norm, clip_grad: float,
                          loss_scale: float) -> None:
        """Fold one group's flat gradient partition (still multiplied by the loss scale) in.

        ``scaled_total_norm``, ``clip_grad`` and ``loss_scale`` are what ``unscale_and_clip_grads``
        receives and reads; they fix the factor the optimizer's gradient is divided by.
        """
        if not self.measuring or group_index in self._observed:
            return
        self._accumulate(group_index, flat_grad)
        self._applied_scale = combined_scale(scaled_total_norm, clip_grad, loss_scale)

    def _accumulate(self, group_index: int, flat_grad: torch.Tensor) -> None:
        slices = self.slices[group_index]
        accumulate_runs(self._stats, slices.views(flat_grad), slices.buckets)
        self._observed.add(group_index)

    def end_step(self) -> None:
        """Reduce this step's statistics across data-parallel ranks and publish them."""
        if not self.measuring:
            return
        self.measuring = False
        if len(self._observed) != len(self.slices):
            logger.warning("layer_grad_norms: step %d saw %d of %d parameter groups; not reported", self.steps,
                           len(self._observed), len(self.slices))
            return
        stats = reduce_stats(self._stats, self.dp_group)
        self._stats = None
        keys = self.layer_map.keys
        pre_clip = bucket_results(stats, keys, self.selected, 1.0 / self._gradient_scale)
        clip_coef = post_clip = None
        if not self._overflow:
            clip_coef = self._gradient_scale / self._applied_scale
            post_clip = bucket_results(stats, keys, self.selected, 1.0 / self._applied_scale)
        self.result = {
            "step": self.steps,
            "overflow": self._overflow,
            "clip_coef": clip_coef,
            "pre_clip": pre_clip,
            "post_clip": post_clip,
        }

    def get(self) -> Optional[Dict[Hashable, object]]:
        """The last measurement, or ``None`` before the first measured step."""
        return self.result
