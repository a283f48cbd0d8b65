# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Hands each reduced result to its readers: the last result (``engine.get_layer_grad_norms()``), the JSONL
dump (rank 0) and DeepSpeed's monitors; and the guarded door every reader inside training goes through.

Each reader is one class of one small interface (``Reader``), as DeepSpeed's ``monitor/`` has one class per
backend: the JSONL dump (``jsonl_dump.JsonlDump``) and DeepSpeed's monitors (``monitor.MonitorEvents``) here; outside
DeepSpeed, the Megatron hook's TensorBoard runs and the Hugging Face Trainer callback's logs. Each is called through
a ``Consumer``: a reader that fails (a full disk, a writer's error) logs one traceback and stops itself on its
rank; it never changes what the ranks do next: training, the statistics and the other readers go on.
"""

import logging
from typing import Any, List, Optional

from ..config import DumpConfig
from .jsonl_dump import JsonlDump
from .process_rank import rank_of_process

logger = logging.getLogger(__name__)


class Reader:
    """One backend's reader of the results. ``write`` takes what it reads (a result; a fire's recorded steps);
    ``flush`` and ``close`` release what it holds, where it holds anything (files, a writer thread)."""

    def write(self, record: Any) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Nothing held, nothing to flush."""

    def close(self) -> None:
        """Nothing held, nothing to close."""


class Consumer:
    """A reader behind the guard: its first failure, in any of its methods, is logged with its traceback and
    switches it off on this rank, its ``close`` tried once, quietly, to free what it holds."""

    def __init__(self, name: str, reader: Reader) -> None:
        self.name, self.reader = name, reader
        self.failed = False

    def __call__(self, record: Any, step: int) -> None:
        """``reader.write(record)``; ``step``: the step it belongs to, for the failure's line."""
        self._guarded("write", record, step=step)

    def flush(self) -> None:
        self._guarded("flush")

    def close(self) -> None:
        self._guarded("close")

    def _guarded(self, method: str, *args: Any, step: Optional[int] = None) -> None:
        if self.failed:
            return
        action = getattr(self.reader, method, None)  # a JsonlDump has nothing to flush or close
        if action is None:
            return
        try:
            action(*args)
        except Exception:
            at = "" if step is None else f" at step {step}"
            logger.exception(
                "layer_grad_norms: %s failed%s on rank %d; it is switched off on this rank, training, the "
                "statistics and the other readers go on", self.name, at, rank_of_process())
            self.failed = True
            self._abandon()

    def _abandon(self) -> None:
        """Free what the failed reader holds; its failure is logged already, so nothing more is."""
        try:
            getattr(self.reader, "close", lambda: None)()
        except Exception:
            pass


class Publisher:
    """The last result and the readers of every result."""

    def __init__(self, dump: Optional[DumpConfig], monitor: Optional[Reader]) -> None:
        """``dump``: the block's ``dump`` key (written by rank 0); ``monitor``: writes a result to DeepSpeed's
        monitors, or ``None``."""
        self.dump = None
        if dump and rank_of_process() == 0:
            self.dump = Consumer("the JSONL dump", JsonlDump(dump.path, dump.max_bytes, dump.backups))
        self.monitor = Consumer("DeepSpeed's monitors", monitor) if monitor is not None else None
        self.result: Optional[dict] = None

    def clear(self) -> None:
        """No result until the step under way is complete: never a stale one."""
        self.result = None

    def publish(self, result: dict, capture: Optional[dict]) -> None:
        """The reduced result of the step just measured; ``capture``: the fire capturing it."""
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
