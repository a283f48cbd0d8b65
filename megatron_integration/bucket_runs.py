"""One TensorBoard run per bucket, beside the Megatron writer's own run.

TensorBoard colours and names lines by run, so each bucket gets a ``SummaryWriter`` of its own, in a
subdirectory of the Megatron writer's log directory (``layer-grad-norms/layer00``). The writers are
created on first use, on the rank that owns the Megatron writer, once per run for the whole job; they
flush when it flushes and close when it closes (its ``flush`` and ``close`` are wrapped), and after
each measured iteration's writes, so that a job that dies keeps every measured step on disk.
"""

import os
from typing import Dict, Optional

_ATTRIBUTE = "_layer_grad_norms_runs"


class BucketRuns:
    """The per-bucket writers of one Megatron writer (``parent``)."""

    def __init__(self, parent) -> None:
        self.parent = parent
        self.writers: Dict[str, object] = {}
        self.layout_written = False
        self.logged_step: Optional[int] = None
        """The step of the last result written: each result is written once, however often it is read."""
        self.logged_fire: Optional[int] = None
        """The step of the last fire whose recorded steps were written: each fire's are written once."""
        self._parent_flush, self._parent_close = parent.flush, parent.close
        parent.flush, parent.close = self._flush_with_parent, self._close_with_parent

    def writer(self, run: str):
        """The writer of ``run`` (a path relative to the parent's log directory), created on first use
        with the parent's queue size and flush period."""
        if run not in self.writers:
            from torch.utils.tensorboard import SummaryWriter

            self.writers[run] = SummaryWriter(os.path.join(self.parent.get_logdir(), run),
                                              max_queue=getattr(self.parent, "max_queue", 10),
                                              flush_secs=getattr(self.parent, "flush_secs", 120))
        return self.writers[run]

    def flush(self) -> None:
        for writer in self.writers.values():
            writer.flush()

    def close_runs(self, prefix: str) -> None:
        """Close and forget the writers of the runs under ``prefix``: runs written once (a fire's recorded
        steps) hold no file open for the rest of the job."""
        for run in [run for run in self.writers if run.startswith(prefix)]:
            self.writers.pop(run).close()

    def _flush_with_parent(self) -> None:
        self.flush()
        self._parent_flush()

    def _close_with_parent(self) -> None:
        """Close every bucket writer, then the parent; a parent used again starts afresh."""
        for writer in self.writers.values():
            writer.close()
        self.writers.clear()
        self.parent.flush, self.parent.close = self._parent_flush, self._parent_close
        delattr(self.parent, _ATTRIBUTE)
        self._parent_close()


def bucket_runs(parent) -> BucketRuns:
    """The per-bucket writers attached to the Megatron writer ``parent``, attached on first call."""
    runs = getattr(parent, _ATTRIBUTE, None)
    if runs is None:
        runs = BucketRuns(parent)
        setattr(parent, _ATTRIBUTE, runs)
    return runs
