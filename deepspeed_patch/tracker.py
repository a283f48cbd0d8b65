# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The per-optimizer state: layer map, partition slices, interval, and the last measurement.

The engine drives it around each optimizer step (``call_sites``), the optimizer in between:

- ``begin_step()`` once before the step; it decides whether this step is measured.
- ``observe(group_index, flat_grad)`` once per parameter group, on the flat gradient partition
  before clipping (still multiplied by the loss scale, if any).
- ``set_gradient_scale(scale)``: the loss scale the gradients carry (1 without fp16).
- ``set_applied_scale(divisor)``: what the optimizer divides the gradient by, loss scale and
  clipping together; not called on a step the loss scaler skips. Or ``set_clip_norm(max_norm)``
  where clipping follows ``torch.nn.utils.clip_grad_norm_`` on the measured gradients: the factor
  then comes from the statistics' own total norm, with no extra read.
- ``end_step(overflow)`` once after the step: one collective, then the result dict.

An error in any of this (a bug, an unforeseen layout) must not stop the training run: it is
logged, the step's table carries a failure flag through the same collective, and every rank then
switches the statistics off together, so no rank is left waiting in a collective the others skip.

Unmeasured steps cost one modulo and a few attribute reads.
"""

import contextlib
import logging
from typing import Callable, Dict, Hashable, List, Optional

import torch
from deepspeed import comm as dist

from .config import LayerGradNormsConfig
from .layer_map import LayerMap
from .on_demand import ControlFile, JsonlDump, SpikeTrigger
from .partition_slices import PartitionSlices
from .statistics import (
    NUMEL,
    accumulate_runs,
    bucket_results,
    empty_stats,
    reduce_stats,
    torch_clip_divisor,
    total_norm,
)

logger = logging.getLogger(__name__)


class LayerGradNormTracker:
    """Per-layer gradient statistics for one optimizer (or one model, in the plain-PyTorch API)."""

    def __init__(self, config: LayerGradNormsConfig, layer_map: LayerMap, slices: List[Optional[PartitionSlices]],
                 group, device, completed_steps: Callable[[], int]) -> None:
        """``slices``: one per parameter group (``None`` for a group observed as separate tensors);
        ``group``: the ranks to combine over, or ``REPLICATED``; ``completed_steps()``: the optimizer steps
        so far (the engine's, restored from a checkpoint), so that ``step`` and the interval follow the
        training iteration."""
        self.enabled = config.enabled
        self.monitor = config.monitor
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
        self.broken = False
        self._failed = False
        self.trigger = None
        if config.trigger is not None:
            self.trigger = SpikeTrigger(config.trigger.grad_norm_factor, config.trigger.window,
                                        config.trigger.capture_steps, config.trigger.on_overflow)
        self.capture: Optional[dict] = None
        self.control = ControlFile(config.control_file, config.control_interval) if config.control_file else None
        self.dump = None
        if config.dump and (not dist.is_initialized() or dist.get_rank() == 0):
            self.dump = JsonlDump(config.dump.path, config.dump.max_bytes, config.dump.backups)
        self.result: Optional[dict] = None
        self._stats: Optional[torch.Tensor] = None
        self._observed = set()
        self._gradient_scale = 1.0
        self._applied_scale = 1.0
        self._clip_norm: Optional[float] = None

    def begin_step(self) -> bool:
        """Number this optimizer step; measure it if it falls on the interval or in a capture window."""
        self.step = self.completed_steps() + 1
        settings = self.control.poll(self.step) if self.control else None
        if settings:
            self._apply_control(settings)
        on_interval = self.enabled and self.step % self.interval == 0
        self.measuring = not self.broken and (on_interval or self.capturing())
        if self.measuring:
            self._stats = empty_stats(len(self.layer_map.keys), self.device)
            self._observed = set()
            self._gradient_scale = self._applied_scale = 1.0
            self._clip_norm = None
        return self.measuring

    def capturing(self) -> bool:
        """Inside the window a trigger opened: every step, every bucket."""
        return self.capture is not None and self.step <= self.capture["capture_until"]

    def set_options(self,
                    enabled: Optional[bool] = None,
                    interval: Optional[int] = None,
                    layers: Optional[object] = None) -> None:
        """Change what is measured on a live run; every rank must call it at the same step."""
        checked = LayerGradNormsConfig(strict=True,
                                       enabled=self.enabled if enabled is None else enabled,
                                       interval=self.interval if interval is None else interval,
                                       layers=layers)
        self.enabled, self.interval = checked.enabled, checked.interval
        if layers is not None:
            self.selected = self.layer_map.select(checked.layers)

    def _apply_control(self, settings: dict) -> None:
        try:
            self.set_options(**settings)
            logger.info("layer_grad_norms: control file applied at step %d: %s", self.step, settings)
        except (TypeError, ValueError) as err:  # the same on every rank: all ignore it
            logger.error("layer_grad_norms: control file settings %s ignored: %s", settings, err)

    def after_step(self, global_norm, overflow: bool) -> None:
        """Feed the trigger the step's global gradient norm (the same on every rank)."""
        if self.trigger is None or self.broken:
            return
        with self.guarded("checking the trigger"):
            norm = None if global_norm is None else float(global_norm)
            fired = self.trigger.update(self.step, norm, bool(overflow))
            if fired is not None:
                logger.warning(
                    "layer_grad_norms: trigger fired at step %d (%s); capturing every layer until step "
                    "%d", self.step, fired["reason"], fired["capture_until"])
                self.capture = fired

    @contextlib.contextmanager
    def guarded(self, what: str):
        """Run measuring work; an error is logged and flags the step instead of reaching training."""
        try:
            yield
        except Exception:
            logger.exception(
                "layer_grad_norms: %s failed at step %d; per-layer statistics are switched off "
                "on all ranks after this step, training goes on", what, self.step)
            self._failed = True

    def observe(self, group_index: int, flat_grad: torch.Tensor) -> None:
        """Fold one group's flat gradient partition in (once per group and step)."""
        slices = self.slices[group_index]
        self.observe_runs(group_index, lambda: slices.views(flat_grad), slices.buckets)

    def observe_runs(self, group_index: int, runs: Callable[[], List[torch.Tensor]], buckets: torch.Tensor) -> None:
        """Fold one group's gradient in, given as 1-D tensors ``runs()`` in ``buckets``."""
        if not self.measuring or group_index in self._observed:
            return
        with self.guarded(f"measuring parameter group {group_index}"):
            accumulate_runs(self._stats, runs(), buckets, self.extra)
            self._observed.add(group_index)

    def set_gradient_scale(self, loss_scale: float) -> None:
        """The loss scale this step's gradients carry; the pre-clip statistics are divided by it."""
        self._gradient_scale = float(loss_scale)

    def set_applied_scale(self, divisor: float) -> None:
        """What the optimizer divides the observed gradient by: loss scale times clip factor."""
        self._applied_scale = float(divisor)

    def set_clip_norm(self, max_norm: float) -> None:
        """Clipping to ``max_norm`` the way ``torch.nn.utils.clip_grad_norm_`` does it."""
        self._clip_norm = max_norm

    def end_step(self, overflow: bool) -> None:
        """Reduce this step's statistics across the ranks and publish them.

        ``overflow``: the loss scaler skipped the step; pre-clip statistics only.
        """
        if not self.measuring:
            return
        self.measuring = False
        complete = not self._failed and len(self._observed) == len(self.slices)
        status = torch.zeros((1, self._stats.shape[1]), dtype=self._stats.dtype, device=self._stats.device)
        status[0, NUMEL] = 0.0 if complete else 1.0
        stats = reduce_stats(torch.cat([self._stats, status]), self.group)
        self._stats = None
        if stats[-1, NUMEL].item() > 0:
            logger.error(
                "layer_grad_norms: a rank could not measure step %d (see its log); per-layer statistics "
                "are switched off", self.step)
            self.broken, self.result = True, None
            return
        with self.guarded("building the result"):
            if self._clip_norm:
                self._applied_scale = torch_clip_divisor(total_norm(stats[:-1]), self._clip_norm)
            self.result = self._result(stats[:-1], overflow)
            if self.dump is not None:
                self.dump.write(self.result)

    def _result(self, stats: torch.Tensor, overflow: bool) -> dict:
        keys = self.layer_map.keys
        selected = keys if self.capturing() else self.selected
        pre_clip = bucket_results(stats, keys, selected, 1.0 / self._gradient_scale, self.extra)
        clip_coef = post_clip = None
        if not overflow:
            clip_coef = self._gradient_scale / self._applied_scale
            post_clip = bucket_results(stats, keys, selected, 1.0 / self._applied_scale, self.extra)
        result = {
            "step": self.step,
            "overflow": bool(overflow),
            "clip_coef": clip_coef,
            "pre_clip": pre_clip,
            "post_clip": post_clip,
        }
        if self.capturing():
            result["trigger"] = dict(self.capture)
        return result

    def get(self) -> Optional[Dict[Hashable, object]]:
        """The last measurement, or ``None`` before the first measured step."""
        return self.result
