# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Hands each reduced result to its readers: the last result (``engine.get_layer_grad_norms()``), the JSONL
dump (rank 0) and DeepSpeed's monitors.

A reader that fails (a full disk under the dump, a monitor's error) stops itself on its rank, logged once;
it never changes what the ranks do next: the statistics, the trigger and the recorder go on.
"""

import logging
from typing import Callable, List, Optional

from .config import DumpConfig
from .on_demand import JsonlDump, rank_of_process

logger = logging.getLogger(__name__)


class Consumer:
    """One reader of the results; its first failure is logged and switches it off on this rank."""

    def __init__(self, name: str, write: Callable[[dict], None]) -> None:
        self.name, self.write = name, write
        self.failed = False

    def __call__(self, record: dict, step: int) -> None:
        if self.failed:
            return
        try:
            self.write(record)
        except Exception:
            logger.exception(
                "layer_grad_norms: %s failed at step %d on rank %d; it is switched off on this rank, the "
                "statistics, the trigger and the recorder go on", self.name, step, rank_of_process())
            self.failed = True


class Publisher:
    """The last result and the readers of every result."""

    def __init__(self, dump: Optional[DumpConfig], monitor: Optional[Callable[[dict], None]]) -> None:
        """``dump``: the block's ``dump`` key (written by rank 0); ``monitor``: writes a result to DeepSpeed's
        monitors, or ``None``."""
        self.dump = None
        if dump and rank_of_process() == 0:
            self.dump = Consumer("the JSONL dump", JsonlDump(dump.path, dump.max_bytes, dump.backups).write)
        self.monitor = Consumer("DeepSpeed's monitors", monitor) if monitor is not None else None
        self.result: Optional[dict] = None

    def clear(self) -> None:
        """No result until the step under way is complete: never a stale one."""
        self.result = None

    def publish(self, result: dict, capture: Optional[dict]) -> None:
        """The reduced result of the step just measured; ``capture``: the fire whose window it is in."""
        if capture is not None:
            result["trigger"] = dict(capture)
        self.result = result
        for consumer in (self.dump, self.monitor):
            if consumer is not None:
                consumer(result, result["step"])

    def publish_history(self, entries: List[dict]) -> None:
        """A fire's newly recorded steps: one dump line each, marked ``"history": true``."""
        if self.dump is not None:
            for entry in entries:
                self.dump({**entry, "history": True}, entry["trigger"]["fired_at"])
