# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Per-layer statistics on demand: a spike trigger, a control file, and a JSONL post-mortem dump.

The original request: "after encountering a spike we could roll back to the last good checkpoint
and run a cycle with this debug feature enabled". Every decision here is taken identically on all
ranks: the trigger reads the global gradient norm (the same number everywhere), the control file
is read by rank 0 and announced to every rank in a collective.
"""

import json
import math
import os
import statistics
from collections import deque
from typing import Any, Dict, Optional

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator


def rank_of_process() -> int:
    """This process's global rank: DeepSpeed's, or under a launcher that did not initialise DeepSpeed's
    communication (torchrun with plain DistributedDataParallel) the ``RANK`` the launcher sets; 0 alone."""
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


WARM_UP = 5
"""Global norms the trigger needs before it judges a spike (fewer if its window is shorter): a median of
one or two steps would fire on ordinary noise."""


class SpikeTrigger:
    """Fires when the global gradient norm jumps above ``factor`` times its running median over the
    last ``window`` steps, when the loss the training loop reports jumps above ``loss_factor`` times its
    own running median, or (``on_overflow``) when the loss scaler has skipped ``overflow_steps`` steps in
    a row; and not again within ``cooldown`` steps of a fire.

    Routine dynamic loss scaling skips a step now and then: a scale that grows until the gradient overflows
    (one or two skipped steps in a row, with DeepSpeed's default hysteresis of 2), and at the start of a run
    the search for a scale from a large initial one. So an overflow fires only once ``overflow_steps`` steps
    in a row were skipped, and a run of skipped steps that begins at step 1 (the search) never fires. A run
    resumed from a checkpoint restores its loss scale: its skipped steps count from the first. A non-finite
    gradient norm on a step the scaler did not skip is no routine: it fires at once.

    The refractory period keeps a sustained spike, which the lagging median sees on every step, from firing
    on every step: after a fire at step F the next can come at step ``F + cooldown`` at the earliest. The
    windows go on filling meanwhile.

    The windows live in memory: they start empty at every start, a resume from a checkpoint included, and
    a median is judged once its window holds ``min(window, WARM_UP)`` values. Until then (the warm-up) only
    an overflow fires it. Saving the windows with the checkpoint would need call sites in the engine's
    checkpoint methods, beyond the optimizer step this package hooks.
    """

    def __init__(self,
                 factor: float,
                 window: int,
                 capture_steps: int,
                 on_overflow: bool,
                 loss_factor: Optional[float] = None,
                 cooldown: int = 1,
                 overflow_steps: int = 1) -> None:
        self.factor, self.capture_steps, self.on_overflow = factor, capture_steps, on_overflow
        self.loss_factor = loss_factor
        self.cooldown, self.overflow_steps = cooldown, overflow_steps
        self.recent: deque = deque(maxlen=window)
        self.recent_losses: deque = deque(maxlen=window)
        self.last_fire: Optional[int] = None
        self.skipped_since: Optional[int] = None
        """The first step of the current run of skipped steps, or ``None``."""

    def update(self,
               step: int,
               global_norm: Optional[float],
               overflow: bool,
               loss: Optional[float] = None) -> Optional[Dict[str, Any]]:
        """Feed one optimizer step; returns what fired, or ``None``.

        ``global_norm`` is ``None`` when the optimizer computed none (``compute_grad_norm: false``); a
        non-finite one on a step the loss scaler did not skip (bf16, fp32: no scaler handles it) fires at
        once, even in the warm-up. ``loss``: the loss reported since the last step, or ``None``; it is
        watched only with a ``loss_factor``.
        """
        if overflow:
            reason = "overflow" if self._overflow_fires(step) else None
        else:
            self.skipped_since = None
            reason = _spike("grad norm", global_norm, self.factor, self.recent)
            if self.loss_factor is not None:
                reason = _spike("loss", loss, self.loss_factor, self.recent_losses) or reason
        if reason is None or (self.last_fire is not None and step - self.last_fire < self.cooldown):
            return None
        self.last_fire = step
        return {"fired_at": step, "reason": reason, "capture_until": step + self.capture_steps}

    def _overflow_fires(self, step: int) -> bool:
        """Count one more skipped step; whether the run of them fires."""
        if self.skipped_since is None:
            self.skipped_since = step
        searching = self.skipped_since == 1
        return self.on_overflow and not searching and step - self.skipped_since + 1 >= self.overflow_steps


def _spike(name: str, value: Optional[float], factor: float, recent: deque) -> Optional[str]:
    """Why ``value`` is a spike against the median of ``recent`` (judged after the warm-up), or ``None``;
    ``value`` then joins ``recent``. ``None`` (nothing reported) is skipped; a non-finite value fires at
    once and stays out of the window."""
    if value is None:
        return None
    if not math.isfinite(value):
        return f"{name} {value}"
    reason = None
    if len(recent) >= min(recent.maxlen, WARM_UP):
        median = statistics.median(recent)
        if value > factor * median:
            reason = f"{name} {value:.4g} > {factor} x median {median:.4g}"
    recent.append(value)
    return reason


class ControlFile:
    """A JSON file (``{"enabled": true, "interval": 1, "layers": "all"}``, any subset) read by rank 0 every
    ``interval`` steps, so that every rank applies it at the same step.

    A poll costs one all-reduce of one integer over all ranks (whether rank 0 found the file changed: the others
    add 0) and the host read of it; the settings themselves are broadcast only on a poll that found them changed.
    No cheaper agreement exists: while the statistics are off no other collective of this package runs for a
    poll to ride in, and without one the ranks cannot agree on the step at which a file one of them read changed.
    """

    def __init__(self, path: str, interval: int) -> None:
        self.path, self.interval = path, interval
        self._seen: Optional[float] = None
        self._flag: Optional[torch.Tensor] = None
        """The last poll's all-reduced flag, referenced until the next (``reduction._LAST_REDUCED`` says why)."""

    def poll(self, step: int) -> Optional[Dict[str, Any]]:
        """The settings to apply at this step (collectives on poll steps), or ``None``."""
        if step % self.interval:
            return None
        if not dist.is_initialized():  # one process (or a plain DDP loop, which has no collective to keep in step)
            return self._read()
        settings = self._read() if dist.get_rank() == 0 else None
        device = get_accelerator().current_device_name()
        changed = self._flag = torch.tensor([int(settings is not None)], device=device)
        dist.all_reduce(changed)
        if not changed.item():
            return None
        message = [settings]
        dist.broadcast_object_list(message, src=0)
        return message[0]

    def _read(self) -> Optional[Dict[str, Any]]:
        try:
            changed = os.stat(self.path).st_mtime_ns
            if changed == self._seen:
                return None
            with open(self.path) as control:
                settings = json.load(control)
            self._seen = changed
        except (OSError, ValueError):
            return None  # absent, or caught half-written: read again at the next poll
        return settings if isinstance(settings, dict) else None


class JsonlDump:
    """One JSON line per measured step, flushed as written, rotated past ``max_bytes`` (rank 0 only).

    Lines are only ever appended: a run resumed or rolled back to an earlier checkpoint writes its repeated
    steps again, after the first run's. The rule for readers (``plot``, ``report``): one entry per step, the
    line written last wins, and the later steps only the abandoned run wrote are dropped: training went on
    from the new lines.
    """

    def __init__(self, path: str, max_bytes: int, backups: int) -> None:
        self.path, self.max_bytes, self.backups = path, max_bytes, backups

    def write(self, record: Dict[str, Any]) -> None:
        line = json.dumps(record, default=str) + "\n"
        if os.path.exists(self.path) and os.path.getsize(self.path) + len(line) > self.max_bytes:
            self._rotate()
        with open(self.path, "a") as out:
            out.write(line)
            out.flush()

    def _rotate(self) -> None:
        for index in range(self.backups - 1, 0, -1):
            if os.path.exists(f"{self.path}.{index}"):
                os.replace(f"{self.path}.{index}", f"{self.path}.{index + 1}")
        if self.backups > 0:
            os.replace(self.path, f"{self.path}.1")
        else:
            os.remove(self.path)
