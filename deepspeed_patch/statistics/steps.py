# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Which optimizer steps are measured (``StepSchedule``), and when the statistics switch off (``FailureLatch``).

Both decide collectives, so both change only with state that is the same on every rank: the engine's step
count, the interval, a runtime switch every rank makes at the same step, the control file (read by rank 0
and broadcast), the trigger's capture (from the global norm), and a failure announced through a
reduction.
"""

import contextlib
import logging
from typing import Callable, Hashable, List, Optional

from ..config import LayerGradNormsConfig
from ..spikes.control_file import ControlFile
from .layer_map import LayerMap

logger = logging.getLogger(__name__)


class StepSchedule:
    """Numbers the optimizer steps; decides which are measured and which buckets they report."""

    def __init__(self, config: LayerGradNormsConfig, layer_map: LayerMap, completed_steps: Callable[[], int]) -> None:
        """``completed_steps()``: the optimizer steps so far (the engine's, restored from a checkpoint), so
        that ``step`` and the interval follow the training iteration."""
        self.enabled = config.enabled
        self.interval = config.interval
        self.layer_map = layer_map
        self.selected = layer_map.select(config.layers)
        self.completed_steps = completed_steps
        self.control = ControlFile(config.control_file, config.control_interval) if config.control_file else None
        self.capture: Optional[dict] = None
        """The record of the trigger's last fire, whose window is captured."""
        self.step = 0

    def next_step(self) -> bool:
        """Number the optimizer step about to run; whether it is measured."""
        self.step = self.completed_steps() + 1
        settings = self.control.poll(self.step) if self.control else None
        if settings:
            self._apply_control(settings)
        return (self.enabled and self.step % self.interval == 0) or self.capturing()

    def capturing(self) -> bool:
        """Inside the window a trigger opened: every step, every bucket."""
        return self.capture is not None and self.step <= self.capture["capture_until"]

    def open_capture(self, fired: dict) -> None:
        """Capture the steps after a fire, up to ``fired["capture_until"]``."""
        self.capture = fired

    def reported_keys(self) -> List[Hashable]:
        return list(self.layer_map.keys if self.capturing() else self.selected)

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


class FailureLatch:
    """A failure of the measurement on one rank switches the statistics off on every rank at the same step.

    The failing rank logs it and flags every later step it opens (``failed_locally``); the flag rides in the status
    row of the next reduction, a measured step's or the recorder's at a fire, and every rank then reads it and
    switches off (``broken``). "Every rank" is the adapter's process group, the one all the statistics'
    collectives run over, so the ranks that switch off together stop every collective together.
    """

    def __init__(self) -> None:
        self.failed_locally = False
        self.broken = False

    @contextlib.contextmanager
    def failing_locally(self, what: str, step: int):
        """Work of the measurement outside its guarded reads (after a collective, or recording): an error here
        is logged once and latched on this rank, to be announced through the next reduction."""
        try:
            yield
        except Exception:
            if not self.failed_locally:
                logger.exception(
                    "layer_grad_norms: %s failed at step %d; per-layer statistics are switched off on all ranks "
                    "at the next measured step or fire, training goes on", what, step)
            self.failed_locally = True

    def switch_off(self, step: int) -> None:
        """A reduction said that a rank could not measure ``step``: off on every rank from now on."""
        if not self.broken:
            logger.error(
                "layer_grad_norms: a rank could not measure step %d (see its log); per-layer statistics are "
                "switched off on all ranks", step)
        self.broken = True
