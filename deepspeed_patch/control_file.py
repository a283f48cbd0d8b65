# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The control file (``ControlFile``): a JSON file a user edits during a run to switch the statistics on or off,
or change their interval and layers, applied by every rank at the same step.

Rank 0 alone reads the file; the other ranks may not see the same file system. The decision to apply what it
read leads to collectives (a measured step's reduction), so it must reach every rank at the same step: it
travels in a collective, which ``ControlFile`` keeps off the steps that have none to spare (see its docstring).
"""

import json
import os
from typing import Any, Dict, Optional

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator


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
