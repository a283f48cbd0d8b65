"""The Megatron hook's two readers of the results, each bucket in a TensorBoard run of its own beside the Megatron
writer's own run, and their attachment to that writer.

TensorBoard colours and names lines by run, so each bucket has a run, a subdirectory of the Megatron writer's log
directory: ``LiveRuns`` writes each logged result into ``layer-grad-norms/layer00``, ``HistoryRuns`` a fire's
recorded steps into ``layer-grad-norms-history/fire-000123/layer00`` (steps going backwards in the live runs would
make TensorBoard purge their later points). Each writes all its runs from one thread (``EventFiles``), flushed on
the Megatron writer's schedule: its ``flush_secs``, its ``flush`` and ``close`` (wrapped), and at the interpreter's
exit (Megatron never closes its writer). Each is called through ``publish.Consumer``: a failure (a full disk, a
writer's error) logs one traceback and stops that reader on this rank; training and the other reader go on.
"""

import atexit
import math
import weakref
from dataclasses import replace
from typing import Dict, Hashable, List, Optional

from deepspeed_patch.outputs.publish import Consumer, Reader
from deepspeed_patch.outputs.tags import (
    HISTORY_ROOT,
    WRITTEN_PHASES,
    history_root,
    history_run_name,
    logged_result,
    phase_statistics,
    step_scalars,
)

from .event_files import EventFiles, Scalar
from .tensorboard_layout import Placement, custom_scalars_layout, placements

_ATTRIBUTE = "_layer_grad_norms_runs"


def drawable(value: float) -> float:
    """``value``, or NaN for an infinite one (an fp16 overflow's pre-clip statistics): TensorBoard marks a
    NaN point with a triangle and draws on; an infinite point it leaves unmarked, a gap in the line, and
    its SVG renderer draws nothing of the line after it."""
    return value if math.isfinite(value) else math.nan


def logged_phases(stats: Dict) -> List[str]:
    """The phases of a result its logs hold: the gradient's, and the kinds and ratio it carries."""
    return [phase for phase in WRITTEN_PHASES if phase in logged_result(stats)]


def bucket_scalars(placed: Dict[Hashable, Placement], stats: Dict) -> List[Scalar]:
    """Each bucket's statistics of one result, in its run, against the result's step; run by run, layers first
    in the result's order: TensorBoard colours runs in the order they start."""
    logged = logged_result(stats)
    ordered = sorted(placed, key=lambda key: placed[key].layer is None)
    return [(placed[key].run, placed[key].tag(phase, statistic), drawable(values[statistic]), stats["step"])
            for key in ordered for phase in WRITTEN_PHASES
            for values in [(logged.get(phase) or {}).get(key)] if values is not None
            for statistic in phase_statistics(phase)]


class _Runs(Reader):
    """A reader writing runs under the Megatron writer's log directory, with that writer's queue size and flush
    period, from one thread."""

    def __init__(self, parent) -> None:
        self.parent = parent
        self.files = EventFiles(parent.get_logdir(), max_queue=getattr(parent, "max_queue", 10),
                                flush_secs=getattr(parent, "flush_secs", 120))

    def flush(self) -> None:
        self.files.flush()

    def close(self) -> None:
        self.files.close()


class LiveRuns(_Runs):
    """Each logged result into each bucket's run; the Custom Scalars layout, once, into the writer's own run."""

    def __init__(self, parent) -> None:
        super().__init__(parent)
        self.layout_written = False

    def write(self, stats: Dict) -> None:
        if not self.layout_written:
            self.parent.add_custom_scalars(custom_scalars_layout(stats["pre_clip"], logged_phases(stats)))
            self.layout_written = True
        self.files.write(bucket_scalars(placements(stats["pre_clip"]), stats))
        for tag, value in step_scalars(stats).items():  # skip_step's decision: the writer's own run
            self.parent.add_scalar(tag, value, stats["step"])


class HistoryRuns(_Runs):
    """A fire's recorded steps (oldest first), each bucket into its run of that fire, then those runs closed:
    they are written once, their steps in order."""

    def write(self, history: List[Dict]) -> None:
        fired_at = history[-1]["trigger"]["fired_at"]
        placed = {
            key: replace(place,
                         run=history_run_name(fired_at, key if place.layer is None else place.layer),
                         root=history_root(place.root))
            for key, place in placements(history[-1]["pre_clip"]).items()
        }
        self.files.write([scalar for stats in history for scalar in bucket_scalars(placed, stats)])
        self.files.close_runs(f"{HISTORY_ROOT}/fire-{fired_at:06d}/")


class BucketRuns:
    """The hook's readers on one Megatron writer (``parent``), and what they have written."""

    def __init__(self, parent) -> None:
        self.parent = parent
        self.live = Consumer("the Megatron hook's TensorBoard runs", LiveRuns(parent))
        self.history = Consumer("the Megatron hook's history runs", HistoryRuns(parent))
        self.logged_step: Optional[int] = None
        """The step of the last result written: each result is written once, however often it is read."""
        self.logged_fire: Optional[int] = None
        """The step of the last fire whose recorded steps were written: each fire's are written once."""
        self._parent_flush, self._parent_close = parent.flush, parent.close
        parent.flush, parent.close = self._flush_with_parent, self._close_with_parent
        _ATTACHED.add(self)

    def flush(self) -> None:
        self.live.flush()
        self.history.flush()

    def _flush_with_parent(self) -> None:
        self.flush()
        self._parent_flush()

    def _close_with_parent(self) -> None:
        """Close both readers, then the parent; a parent used again starts afresh."""
        self.live.close()
        self.history.close()
        _ATTACHED.discard(self)
        self.parent.flush, self.parent.close = self._parent_flush, self._parent_close
        delattr(self.parent, _ATTRIBUTE)
        self._parent_close()


_ATTACHED: "weakref.WeakSet[BucketRuns]" = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    """What is queued reaches the files before the process ends: Megatron never closes its writer."""
    for runs in list(_ATTACHED):
        runs.flush()


def bucket_runs(parent) -> BucketRuns:
    """The hook's readers attached to the Megatron writer ``parent``, attached on first call."""
    runs = getattr(parent, _ATTRIBUTE, None)
    if runs is None:
        runs = BucketRuns(parent)
        setattr(parent, _ATTRIBUTE, runs)
    return runs
