"""The TensorBoard events files of many runs, written by one thread.

A run is a directory with its own events file. A ``SummaryWriter`` per run would hold a writer thread per run:
with ``granularity: "param"`` or a fire's history runs, hundreds of threads. ``EventFiles`` writes every run's
file from one thread, with TensorBoard's own pieces (its file layer and record format, as ``SummaryWriter``'s
``EventFileWriter`` does), and flushes as that writer does: the first write at once, then every ``flush_secs``,
and when asked. The training thread only queues; a failure of the thread (a full disk) is raised by the next
call that queues, flushes or closes.
"""

import itertools
import os
import queue
import socket
import threading
import time
from typing import Dict, List, Optional, Set, Tuple

Scalar = Tuple[str, str, float, int]
"""``(run, tag, value, step)``: ``run`` a path relative to the log directory."""

_STOP = object()
_TICK = 1e-6
"""Each scalar's wall time is at least this after the one before: readers order series by their first wall time
(``log_sources.tensorboard_scalars``, as TensorBoard orders points), so that order is the order written."""
_POLL_SECONDS = 0.1  # how often a caller waiting on the thread checks that it is still alive
_FILE_NUMBER = itertools.count()


class EventFiles:
    """Every run's events file under ``logdir``, written by one thread (started on the first write)."""

    def __init__(self, logdir: str, max_queue: int = 10, flush_secs: float = 120) -> None:
        self.logdir, self.max_queue, self.flush_secs = logdir, max_queue, flush_secs
        self._worker: Optional[_Worker] = None

    def write(self, scalars: List[Scalar]) -> None:
        """Queue ``scalars`` (one item, however many), stamped with the time now."""
        if self._worker is None:
            self._worker = _Worker(self.logdir, self.max_queue, self.flush_secs)
            self._worker.start()
        self._put(("scalars", time.time(), scalars))

    def close_runs(self, prefix: str) -> None:
        """Flush and close the files of the runs under ``prefix`` (runs written once hold nothing open)."""
        if self._worker is not None:
            self._put(("close", prefix))

    def flush(self) -> None:
        """Return once everything queued so far is written and flushed."""
        if self._worker is None:
            return
        done = threading.Event()
        self._put(("flush", done))
        while not done.wait(_POLL_SECONDS):
            self._check()
        self._check()

    def close(self) -> None:
        """Write what is queued, close every file and stop the thread; a later write starts afresh."""
        worker, self._worker = self._worker, None
        if worker is None:
            return
        if worker.error is None and worker.is_alive():
            _put(worker, _STOP)
            worker.join()
        if worker.error is not None:
            raise worker.error

    def _put(self, item) -> None:
        _put(self._worker, item)

    def _check(self) -> None:
        _check(self._worker)


def _put(worker: "_Worker", item) -> None:
    """Queue ``item`` for ``worker``, raising its failure rather than waiting on a dead thread."""
    _check(worker)
    while True:
        try:
            worker.queue.put(item, timeout=_POLL_SECONDS)
            return
        except queue.Full:
            _check(worker)


def _check(worker: "_Worker") -> None:
    if worker.error is not None:
        raise worker.error
    if not worker.is_alive():
        raise RuntimeError(f"the events writer of {worker.logdir} has stopped")


class _Worker(threading.Thread):
    """The thread: one events file per run, opened on the run's first scalar."""

    def __init__(self, logdir: str, max_queue: int, flush_secs: float) -> None:
        super().__init__(name=f"layer-grad-norms events {logdir}", daemon=True)
        self.logdir, self.flush_secs = logdir, flush_secs
        self.queue: "queue.Queue" = queue.Queue(max(1, max_queue))
        self.error: Optional[BaseException] = None
        self._files: Dict[str, object] = {}
        self._pending: Set[str] = set()
        self._next_flush = 0.0  # the first write is flushed at once
        self._wall_time = 0.0

    def run(self) -> None:
        try:
            self._serve()
        except BaseException as error:  # raised in the training thread by the next call
            self.error = error

    def _serve(self) -> None:
        while True:
            timeout = max(0.0, self._next_flush - time.time()) if self._pending else None
            try:
                item = self.queue.get(timeout=timeout)
            except queue.Empty:
                item = None
            if item is _STOP:
                self._close_runs("")
                return
            if item is not None:
                self._handle(item)
            if self._pending and time.time() >= self._next_flush:
                self._flush()

    def _handle(self, item) -> None:
        kind, argument = item[0], item[1:]
        if kind == "scalars":
            self._write(*argument)
        elif kind == "close":
            self._close_runs(argument[0])
        else:
            self._flush()
            argument[0].set()

    def _write(self, wall_time: float, scalars: List[Scalar]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        for run, tag, value, step in scalars:
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)])
            self._wall_time = max(wall_time, self._wall_time + _TICK)
            self._file(run).write(Event(wall_time=self._wall_time, step=step, summary=summary).SerializeToString())
            self._pending.add(run)

    def _file(self, run: str):
        """The run's record writer, its file begun as ``EventFileWriter`` begins one."""
        if run not in self._files:
            from tensorboard.compat import tf
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.summary.writer.record_writer import RecordWriter

            directory = os.path.join(self.logdir, run)
            tf.io.gfile.makedirs(directory)
            name = "events.out.tfevents.%010d.%s.%s.%s" % (time.time(), socket.gethostname(), os.getpid(),
                                                           next(_FILE_NUMBER))
            writer = RecordWriter(tf.io.gfile.GFile(os.path.join(directory, name), "wb"))
            writer.write(Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
            self._files[run] = writer
            self._pending.add(run)
        return self._files[run]

    def _flush(self) -> None:
        for run in sorted(self._pending):
            self._files[run].flush()
        self._pending.clear()
        self._next_flush = time.time() + self.flush_secs

    def _close_runs(self, prefix: str) -> None:
        for run in [run for run in self._files if run.startswith(prefix)]:
            self._files.pop(run).close()
            self._pending.discard(run)
