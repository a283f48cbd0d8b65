# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The trigger's state across steps (``TriggerState``): the spike trigger, the loss reported since the last step,
and its fires with the steps the flight recorder held at each; and the two as one collaborator of an adapter
(``SpikeWatch``): each step recorded, the recorded steps reduced at a fire.

It changes only with what is the same on every rank of the process group (the global norm, the loss scaler's
overflow, the largest loss any of them reported: ``reduction.agreed_losses``), so they all fire at the same step,
whatever the training loop reports on each and whatever a reader of the results does on one of them.
"""

import logging
from typing import Collection, Dict, List, Optional, Sequence, Union

import torch

from ..config import TriggerConfig
from ..outputs.process_rank import rank_of_process
from ..statistics.layer_map import LayerMap
from ..statistics.measurement import Measurement
from ..statistics.reduction import LossAgreement, reported_loss
from ..statistics.steps import FailureLatch
from .recorder import FlightRecorder, Replay
from .spike_rule import SpikeTrigger

logger = logging.getLogger(__name__)

History = Union[None, List[dict], Dict[int, List[dict]]]
"""What ``TriggerState.history`` returns: one fire's recorded steps, or every kept fire's by its step."""
FireSelector = Union[None, int, str]
"""Which fire ``TriggerState.history`` reads: ``None`` (the last), a step, or ``"all"``."""

KEPT_FIRES = 16
"""Fires whose recorded steps stay readable (``history(fire)``); older ones are in the dump and TensorBoard."""


class TriggerState:
    """Whether a step fires the trigger; the fires so far and their recorded steps, each step kept once."""

    def __init__(self, config: Optional[TriggerConfig], losses: Optional[LossAgreement] = None) -> None:
        """``losses``: the adapter's, over which the loss is agreed (one of its own, for one process, by default)."""
        self.trigger = None
        if config is not None:
            self.trigger = SpikeTrigger(config.grad_norm_factor,
                                        config.window,
                                        config.capture_steps,
                                        config.on_overflow,
                                        config.loss_factor,
                                        cooldown=config.refractory_steps(),
                                        overflow_steps=config.overflow_steps)
        self.loss = None
        """Its reader of the loss where it watches one (``loss_factor``): judged at the end of the next step."""
        if config is not None and config.loss_factor is not None:
            self.loss = (losses or LossAgreement()).reader()
        self.fires: Dict[int, List[dict]] = {}
        """Each kept fire's newly recorded steps, by the step it fired at, oldest fire first."""
        self.published_until = 0
        """The newest step a fire's recorded steps included: a later fire's start after it."""

    def after_step(self, step: int, global_norm, overflow: bool) -> Optional[dict]:
        """Feed the trigger the step's global gradient norm (the same on every rank) and the largest loss the
        ranks reported since the last step; what fired, or ``None``."""
        if self.trigger is None:
            return None
        watched_norm = global_norm if self.trigger.norm_ratio is not None else None  # not read when not watched
        loss = None
        if self.loss is not None:
            loss = self.loss.agree(step)
        norm, loss = _on_host(watched_norm, loss)
        loss = reported_loss(loss)
        fired = self.trigger.update(step, norm, bool(overflow), loss)
        if fired is not None and rank_of_process() == 0:  # the same fire on every rank: one line
            logger.warning("layer_grad_norms: trigger fired at step %d (%s); capturing every layer until step %d",
                           step, fired["reason"], fired["capture_until"])
        return fired

    def keep(self, fired: dict, recorded: List[dict]) -> List[dict]:
        """A fire's recorded steps (oldest first), those after ``published_until`` only, each carrying the
        fire's record: kept as the fire's, and returned to be published."""
        entries = [entry for entry in recorded if entry["step"] > self.published_until]
        for entry in entries:
            entry["trigger"] = dict(fired)
        self.fires[fired["fired_at"]] = entries
        while len(self.fires) > KEPT_FIRES:
            del self.fires[next(iter(self.fires))]
        self.published_until = max(self.published_until, fired["fired_at"])
        return entries

    def history(self, fire: FireSelector = None) -> History:
        """``None``: the last fire's recorded steps, or ``None`` before any fire; a step: the recorded steps
        of the fire at that step (``None`` if none fired there, or it is no longer kept); ``"all"``: every
        kept fire's, by the step it fired at."""
        if fire == "all":
            return dict(self.fires)
        if fire is None:
            return self.fires[next(reversed(self.fires))] if self.fires else None
        return self.fires.get(fire)


class SpikeWatch:
    """An adapter's trigger and, with ``trigger.history``, its flight recorder; what fails here goes to the
    adapter's failure latch (``latch``)."""

    def __init__(self,
                 config: TriggerConfig,
                 layer_map: LayerMap,
                 device,
                 losses: LossAgreement,
                 latch: FailureLatch,
                 kinds: Sequence[str] = ()) -> None:
        self.trigger = TriggerState(config, losses)
        self.recorder = FlightRecorder(config.history, layer_map.num_rows, device, kinds) if config.history else None
        self.capture_steps = config.capture_steps
        self.keys = layer_map.keys
        self.latch = latch

    def record(self, measurement: Measurement, overflow: bool) -> None:
        """Push the step's local table into the recorder's ring, if there is one: no collective, no host copy."""
        if self.recorder is not None:
            with self.latch.failing_locally("recording the step", measurement.step):
                self.recorder.push(measurement.local_table(), measurement.scales(overflow))

    def skip_fire(self, step: int, reason: str) -> dict:
        """A step ``skip_step`` skipped opens the trigger's capture (and reduces the recorder) like a fire."""
        return {"fired_at": step, "reason": f"skip_step: {reason}", "capture_until": step + self.capture_steps}

    def replay(self, fired: dict, process_group, extra: Collection[str]) -> List[dict]:
        """At a fire: the recorded steps no earlier fire published, reduced across ``process_group`` (every rank
        calls it) and kept as the fire's; returned to be published. A rank's failure flag on the fire's own step
        switches the statistics off (the failure latch)."""
        if self.recorder is None:
            return []
        step = fired["fired_at"]
        with self.latch.failing_locally("reducing the recorded steps", step):
            replay = self.recorder.replay(process_group, self.keys, extra, after=self.trigger.published_until)
            _log_left_out(replay, step)
            if step in replay.failed:
                self.latch.switch_off(step)
            return self.trigger.keep(fired, replay.results)
        return []  # it failed on this rank: the latch has it


def _log_left_out(replay: Replay, step: int) -> None:
    """Name the recorded steps a fire leaves out because the ranks disagree on them or a rank failed."""
    if replay.disagreeing:
        slots = ", ".join(f"{_step_name(low)} to {_step_name(high)}" for low, high in replay.disagreeing)
        logger.warning(
            "layer_grad_norms: the fire at step %d leaves out recorded steps on which the ranks disagree (a rank "
            "missed recording a step): %s", step, slots)
    if replay.failed:
        logger.warning("layer_grad_norms: the fire at step %d leaves out recorded steps a rank could not measure: %s",
                       step, replay.failed)


def _step_name(step: float) -> str:
    return str(int(step)) if abs(step) != float("inf") else "none"


def _on_host(*values) -> List[Optional[float]]:
    """``values`` (floats, tensors or ``None``) as floats: the tensors among them in one host copy."""
    tensors = [value for value in values if isinstance(value, torch.Tensor)]
    if len(tensors) > 1:
        tensors = torch.cat([tensor.reshape(1).double() for tensor in tensors]).tolist()
    read = iter(float(value) for value in tensors)
    return [
        next(read) if isinstance(value, torch.Tensor) else None if value is None else float(value) for value in values
    ]
