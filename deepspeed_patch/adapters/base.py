# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What every optimizer family's adapter shares: the step protocol the engine drives.

``begin_step()`` at the top of the engine's ``_take_model_step`` opens a ``Measurement`` when the step is measured;
the optimizer's read points (the family's adapter's methods, named after the DeepSpeed method they sit in) fold
each gradient partition into it; ``end_step()`` at the end of ``_take_model_step`` reduces and publishes it. What
leads to a collective is the same on every rank, whatever failed on one (``steps.FailureLatch``).
"""

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from ..capabilities import Capabilities
from ..config import LayerGradNormsConfig
from ..optimizer_state.optimizer_stats import OptimizerStatistics
from ..outputs.publish import Publisher, Reader
from ..remedies.remedies import CHECKPOINT_KEY, saved_state
from ..remedies.remedy_step import RemedyStep
from ..spikes.trigger import FireSelector, History, SpikeWatch
from ..statistics.layer_map import LayerMap
from ..statistics.measurement import Measurement
from ..statistics.reduction import LossAgreement
from ..statistics.statistics import empty_stats, table_rows
from ..statistics.steps import FailureLatch, StepSchedule

logger = logging.getLogger(__name__)

BucketOf = Callable[[torch.nn.Parameter], Optional[int]]


@dataclass(frozen=True)
class Setup:
    """What an adapter is built from, worked out once at start-up (``attach``)."""

    config: LayerGradNormsConfig
    layer_map: LayerMap
    bucket_of: BucketOf
    """A parameter's row in the statistics table (``LayerMap.bucket_of``); ``None`` for one another rank counts."""
    process_group: object
    """The ranks whose tables add up to the whole model; ``REPLICATED`` where each holds it all."""
    completed_steps: Callable[[], int]
    """The engine's optimizer steps so far, restored from checkpoints: the step numbering."""
    monitor: Optional[Reader] = None
    """Writes a measured step's result to DeepSpeed's monitors, when the ds_config enables any."""
    capabilities: Optional[Capabilities] = None
    """How the DeepSpeed release behaves where an adapter depends on it; ``None`` outside DeepSpeed."""


class LayerGradNormsAdapter:
    """Per-layer gradient statistics of one optimizer: its step schedule, the open measurement, the published
    results."""

    def __init__(self, setup: Setup, num_partitions: int, device) -> None:
        """``num_partitions``: the gradient partitions a measured step observes (one per parameter group, or
        ZeRO-3 sub-group); ``device``: where the statistics are computed (that of the partitions)."""
        self.schedule = StepSchedule(setup.config, setup.layer_map, setup.completed_steps)
        self.latch = FailureLatch()
        self.losses = LossAgreement(setup.process_group)
        """The losses ``report_loss`` hands its readers, agreed over the ranks in one all-reduce a step."""
        self.publisher = Publisher(setup.config.dump, setup.monitor)
        self.layer_map = setup.layer_map
        self.process_group = setup.process_group
        self.extra = setup.config.statistics
        self.kinds = setup.config.optimizer_statistics
        self.optimizer_statistics: Optional[OptimizerStatistics] = None
        """The reader of ``kinds``, set by the families that have one (``refusals.check_optimizer_statistics``)."""
        self.num_partitions = num_partitions
        self.device = device
        self.measurement: Optional[Measurement] = None
        self.table = empty_stats(table_rows(self.layer_map.num_rows, self.kinds), device)
        """Every measured or recorded step's table and status row, filled in place (``Measurement``)."""
        self.reporting = False
        """Whether the step under way is measured (reduced and published), not only recorded."""
        self.remedy_step: Optional[RemedyStep] = None
        """``adaptive_clipping`` and ``skip_step``, when either is on (set by the families they act in): then every
        step is measured, and reduced before the optimizer steps (``RemedyStep.act``)."""
        trigger = setup.config.trigger
        self.spikes = SpikeWatch(trigger, self.layer_map, device, self.losses, self.latch,
                                 self.kinds) if trigger is not None else None
        """The spike trigger and its flight recorder (``trigger``)."""
        self.wants_loss = (trigger is not None and trigger.loss_factor is not None) or setup.config.skip_step.enabled
        """Whether ``report_loss`` is needed: a trigger watches the loss (``trigger.loss_factor``), or
        ``skip_step`` does."""

    def begin_step(self) -> None:
        """Top of the engine's optimizer step: open a measurement if this step is measured or recorded."""
        self.reporting = (self.schedule.next_step() or self.remedy_step is not None) and not self.latch.broken
        if self.remedy_step is not None:
            self.remedy_step.begin(self.schedule.step)
        if not (self.reporting or (self.recording() and not self.latch.broken)):
            return
        self.measurement = Measurement(self.schedule.step,
                                       self.layer_map.num_rows,
                                       self.num_partitions,
                                       self.device,
                                       self.extra,
                                       failed=self.latch.failed_locally,
                                       table=self.table,
                                       kinds=self.kinds)
        with self.measurement.guarded("reading the gradients"):
            self.read_at_begin(self.measurement)
        self.act_at_begin(self.measurement)
        if self.optimizer_statistics is not None:
            with self.measurement.guarded("reading the optimizer's hyper-parameters"):
                self.optimizer_statistics.begin_step()

    def end_step(self) -> None:
        """End of the engine's optimizer step: record it, reduce and publish a measured step, feed the
        trigger, and when it fires reduce the recorded steps. What leads to a collective here (``reporting``,
        the fire) is the same on every rank, whatever failed on one."""
        measurement, self.measurement = self.measurement, None
        try:
            with self.latch.failing_locally("ending the step", self.schedule.step):  # last resort: never into training
                self._end(measurement)
        finally:
            if self.remedy_step is not None:
                self.remedy_step.restore_clipping()

    def _end(self, measurement: Optional[Measurement]) -> None:
        action = measurement.action if measurement is not None else None
        skipped = action is not None and action.skipped
        overflow = self.overflow() and not skipped  # a step skip_step skipped goes the overflow's way in DeepSpeed
        if self.remedy_step is not None:
            self.remedy_step.end(measurement, overflow)
        if measurement is not None:
            self._close(measurement, overflow)
        if self.spikes is None or self.latch.broken:
            return
        step = self.schedule.step
        norm = action.global_norm if skipped else self.global_norm()  # DeepSpeed's is inf on a skipped step
        fired = self.spikes.trigger.after_step(step, norm, overflow)
        if fired is None and skipped:
            fired = self.spikes.skip_fire(step, action.skip_reason)
        if fired is not None:
            self.schedule.open_capture(fired)
            self.publisher.publish_history(self.spikes.replay(fired, self.process_group, self.extra))

    def _close(self, measurement: Measurement, overflow: bool) -> None:
        """Record the step, and reduce and publish it if it is measured."""
        step = measurement.step
        with measurement.guarded("reading the applied divisor"):
            self.read_at_end(measurement, overflow)
        if measurement.kinds:
            with measurement.guarded("reading the optimizer state"):
                self.read_optimizer_state(measurement, overflow)
        if self.spikes is not None:
            self.spikes.record(measurement, overflow)
        if self.reporting:
            self.publisher.clear()
            result = finished = None
            with self.latch.failing_locally("finishing the step", step):
                result = measurement.finish(self.process_group, overflow, self.layer_map.keys,
                                            self.schedule.reported_keys())
                finished = True
            if finished and result is None:
                self.latch.switch_off(step)
            elif result is not None:
                self.publisher.publish(result, self.schedule.capture if self.schedule.capturing() else None)
        if measurement.failed:
            self.latch.failed_locally = True

    def save_remedies(self, state_dict: dict) -> None:
        """At the end of the optimizer's ``state_dict``: the remedies' state joins the checkpoint it writes."""
        if self.remedy_step is not None:
            state_dict[CHECKPOINT_KEY] = self.remedy_step.remedies.state_dict()

    def load_remedies(self, state_dict_list, checkpoint_folder: Optional[str] = None) -> None:
        """At the top of the optimizer's ``load_state_dict``: the remedies' state from the checkpoint, its ZeRO files'
        ``state_dict_list`` or, for a universal checkpoint (``state_dict_list`` ``None``), ``checkpoint_folder``
        (``remedies.saved_state``). A checkpoint without it restarts them, named in a warning."""
        if self.remedy_step is not None:
            self.remedy_step.remedies.load_state_dict(saved_state(state_dict_list, checkpoint_folder) or {})

    def read_at_begin(self, measurement: Measurement) -> None:
        """Families whose gradients are complete when the step begins read them here."""

    def act_at_begin(self, measurement: Measurement) -> None:
        """Families that read at the beginning let the remedies act then (``act``), on every rank."""

    def read_at_end(self, measurement: Measurement, overflow: bool) -> None:
        """Families whose applied divisor is known only once the step is done record it here."""

    def read_optimizer_state(self, measurement: Measurement, overflow: bool) -> None:
        """After the optimizer step, on a measured step with ``optimizer_statistics``: fold the requested
        kinds into ``measurement.kind_stats``, a skipped step's update as zero. Every family that has a reader
        sets ``optimizer_statistics``; the others are refused at initialize
        (``refusals.check_optimizer_statistics``)."""
        self.optimizer_statistics.accumulate(measurement.kind_stats, skipped=overflow)

    def applied_divisor(self, combined_scale) -> None:
        """On what an optimizer's ``unscale_and_clip_grads`` returns, where it returns the one divisor it applies
        to the gradient, loss scale and clipping together (FP16_Optimizer's and FP16_UnfusedOptimizer's
        ``combined_scale``)."""
        if self.measurement is not None:
            self.measurement.set_applied_divisor(combined_scale)

    def overflow(self) -> bool:
        """Whether the loss scaler skipped this step."""
        return False

    def global_norm(self) -> Optional[float]:
        """The step's global gradient norm as the optimizer reports it (``None``: not computed)."""
        return None

    def recording(self) -> bool:
        """Whether every step is recorded (``trigger.history``), measured or not."""
        return self.spikes is not None and self.spikes.recorder is not None

    def result(self) -> Optional[dict]:
        """The statistics of the last measured step (``engine.get_layer_grad_norms()``), or ``None``."""
        return self.publisher.result

    def history(self, fire: FireSelector = None) -> History:
        """The recorded steps of the trigger's fires (``engine.get_layer_grad_norms_history()``), oldest first:
        the last fire's, a given fire's, or every kept fire's (``TriggerState.history``); none without a trigger."""
        if self.spikes is None:
            return {} if fire == "all" else None
        return self.spikes.trigger.history(fire)

    def report_loss(self, loss: Union[float, torch.Tensor], before_step: bool = True) -> None:
        """The training step's loss, for ``trigger.loss_factor`` and ``skip_step``: best the same value on every
        rank (a loss averaged across the ranks, as Megatron's reduced loss is). The trigger judges it at the end of
        the next optimizer step, whether it was reported before ``engine.step()`` of its step or after it.
        ``skip_step`` decides the skip of the step whose ``engine.step()`` comes after the loss (``before_step``); a
        loss reported after its step (``before_step=False``, as Megatron's training-log hook does) is the trigger's
        alone.
        The largest loss any rank reported is judged (``reduction.agreed_losses``), so ranks reporting other values,
        or none, still decide together. Without a ``loss_factor`` or ``skip_step`` (``wants_loss`` false) the loss
        is ignored, not read: a device tensor stays there."""
        if self.spikes is not None and self.spikes.trigger.loss is not None:
            self.spikes.trigger.loss.report(loss)
        if self.remedy_step is not None and before_step:
            self.remedy_step.remedies.report_loss(loss)

    def set_options(self,
                    enabled: Optional[bool] = None,
                    interval: Optional[int] = None,
                    layers: Optional[object] = None) -> None:
        """``engine.set_layer_grad_norms()``: change what is measured; every rank at the same step."""
        self.schedule.set_options(enabled=enabled, interval=interval, layers=layers)
