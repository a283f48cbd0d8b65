# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The control file (``ControlFile``): a JSON file a user edits during a run to switch the statistics on or off,
or change their interval and layers, applied by every rank at the same step.

Rank 0 alone reads it (the other ranks may not see the same file system), and only a collective can tell the
others at the same step: while the statistics are off, no other collective of this package runs to carry it, and
DeepSpeed's own cannot without changing their results. Its cost and timing are ``ControlFile``'s.
"""

import json
import os
from typing import Any, Dict, Optional

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator


class ControlFile:
    """A JSON file (``{"enabled": true, "interval": 1, "layers": "all"}``, any subset) read by rank 0 every
    ``interval`` steps; every rank applies what a poll found at the next poll, at the same step.

    Each poll issues one all-reduce of one integer (whether rank 0 found the file changed: the others add 0)
    without waiting for it, and reads the previous poll's, complete by then; a previous poll that found the file
    changed adds the broadcast of its settings (``broadcast_object_list``) to this one. So a change is applied
    ``interval`` to ``2 * interval`` steps after the file was written.
    """

    def __init__(self, path: str, interval: int) -> None:
        self.path, self.interval = path, interval
        self._seen: Optional[float] = None
        self._in_flight: Optional[_Poll] = None
        """The previous poll, whose all-reduce is read at the next (and referenced until then: the reduced
        tensor's last reference stays Python's, ``reduction._LAST_REDUCED`` says why)."""
        self._host: Optional[torch.Tensor] = None
        """On an accelerator: the pinned host copy of each poll's flag, allocated once."""

    def poll(self, step: int) -> Optional[Dict[str, Any]]:
        """The settings to apply at this step, or ``None``; on poll steps, one all-reduce issued (the next
        poll reads it) and, after a poll that found a change, the broadcast of its settings."""
        if step % self.interval:
            return None
        if not dist.is_initialized():  # one process (or a plain DDP loop, which has no collective to keep in step)
            return self._read()
        previous, self._in_flight = self._in_flight, None
        settings = None
        if previous is not None and previous.changed():  # the same reduced flag on every rank
            message = [previous.settings]
            dist.broadcast_object_list(message, src=0)
            settings = message[0]
        accelerator = get_accelerator()
        if accelerator.Event is not None and self._host is None:
            self._host = accelerator.pin_memory(torch.empty(1, dtype=torch.int64))
        self._in_flight = _Poll(self._read() if dist.get_rank() == 0 else None, self._host)
        return settings

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


class _Poll:
    """One poll's all-reduced "changed" flag, on its way: issued here, read by the next poll (``changed``)."""

    def __init__(self, settings: Optional[Dict[str, Any]], host: Optional[torch.Tensor]) -> None:
        """``settings``: what rank 0 read (``None``: unchanged, and on every other rank); ``host``: on an
        accelerator, the pinned tensor the flag is copied into (``None`` on the host)."""
        accelerator = get_accelerator()
        self.settings, self.host = settings, host
        self.flag = torch.full((1, ),
                               int(settings is not None),
                               dtype=torch.int64,
                               device=accelerator.current_device_name())
        self.work = dist.all_reduce(self.flag, async_op=True)
        self.done = None
        if host is not None:  # an accelerator: the device copies the flag out, the host goes on
            self.work.wait()  # the device's stream waits for the all-reduce, not the host
            host.copy_(self.flag, non_blocking=True)
            self.done = accelerator.Event()
            self.done.record()

    def changed(self) -> bool:
        """Whether rank 0 found the file changed: the all-reduced flag, read on the host."""
        if self.done is None:  # on the host (gloo): the all-reduce completed during the interval
            self.work.wait()
            return bool(self.flag.item())
        self.done.synchronize()  # the copy, queued an interval ago
        return bool(self.host.item())
