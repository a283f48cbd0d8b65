# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""One measured optimizer step (``Measurement``): what the read points fold into its table, and its reduction.

An error while measuring is logged and flagged in the step's table, and every rank switches the statistics off
together (``steps.FailureLatch``): no rank waits in a collective the others skip, none keeps a result the others lack.
"""

import contextlib
import logging
from typing import Callable, Hashable, Optional, Sequence

import torch

from ..remedies.remedies import Action
from .partition_slices import PartitionSlices
from .partition_stats import accumulate_partition, accumulate_spans
from .reduction import reduce_stats
from .result import NormFormula, StepScales, host_copy, resolve_scales, step_result
from .statistics import MAX, NEG_MIN, NUMEL, SUMSQ, empty_stats, reset_stats, table_rows

logger = logging.getLogger(__name__)


class Measurement:
    """The statistics of one measured optimizer step, gathered by the optimizer's read points."""

    def __init__(self,
                 step: int,
                 num_buckets: int,
                 num_partitions: int,
                 device,
                 extra: Sequence[str],
                 failed: bool = False,
                 table: Optional[torch.Tensor] = None,
                 kinds: Sequence[str] = ()) -> None:
        """``num_partitions``: the gradient partitions to observe before the step is complete (one per parameter
        group, or ZeRO-3 sub-group); ``table``: a ``(table_rows(num_buckets, kinds), 9)`` buffer to fill (the
        owner's, reset here in place, so that a step allocates no table), else a new one. Its last row is the
        status row ``local_table`` writes; ``kinds`` (``optimizer_statistics``) add one block of ``num_buckets``
        rows each after the gradient's.
        ``failed``: a failure already known on this rank, to be announced through ``finish``."""
        self.step = step
        rows = table_rows(num_buckets, kinds)
        self.table = empty_stats(rows, device) if table is None else reset_stats(table)
        self.stats = self.table[:num_buckets]
        self.kinds = tuple(kinds)
        blocks = self.table[:-1].view(1 + len(kinds), num_buckets, -1)
        self.kind_stats = dict(zip(kinds, blocks[1:]))
        """The rows of each statistic ``kinds`` names, views of the one table."""
        self.num_partitions = num_partitions
        self.extra = extra
        self.observed = set()
        self.gradient_scale = 1.0
        self.applied_divisor = 1.0
        self.clip_norm: Optional[float] = None
        self.clip_square: Optional[torch.Tensor] = None
        self.divisor_of_norm: Optional[NormFormula] = None
        self.failed = failed
        self.finished = False
        self.reduced: Optional[torch.Tensor] = None
        """The table reduced before the optimizer step (``reduce_now``), on the host; ``finish`` reuses it."""
        self.action: Optional[Action] = None
        """What the remedies did to the step (``remedies.Remedies.decide``), if any is on."""

    @contextlib.contextmanager
    def guarded(self, what: str):
        """Run measuring work; an error flags the step instead of reaching training, logged unless the step
        was flagged already (a rank logs a failure once: the steps it opens after one are flagged)."""
        try:
            yield
        except Exception:
            if not self.failed:
                logger.exception(
                    "layer_grad_norms: %s failed at step %d; per-layer statistics are switched off on all "
                    "ranks at the next reduction (this step's if it is measured, else the next measured step's "
                    "or fire's), training goes on", what, self.step)
            self.failed = True

    def observe_partition(self, index: int, flat_grad: torch.Tensor, slices: PartitionSlices) -> None:
        """Fold in flat gradient partition ``index``, laid out as ``slices`` says (once per partition)."""
        if self._wanted(index):
            accumulate_partition(self.stats, flat_grad, slices, self.extra)
            self.observed.add(index)

    def observe(self, index: int, spans: Sequence[torch.Tensor], buckets: torch.Tensor) -> None:
        """Fold in partition ``index``'s gradient, as 1-D tensors ``spans`` in ``buckets`` (once per partition)."""
        if self._wanted(index):
            accumulate_spans(self.stats, spans, buckets, self.extra)
            self.observed.add(index)

    def _wanted(self, index: int) -> bool:
        if self.finished:
            raise RuntimeError(f"layer_grad_norms: step {self.step} is finished; nothing more can be observed")
        return not self.failed and index not in self.observed

    def set_gradient_scale(self, loss_scale: float) -> None:
        """The loss scale the observed gradients carry; the pre-clip statistics are divided by it."""
        self.gradient_scale = float(loss_scale)

    def set_applied_divisor(self, divisor: float) -> None:
        """What the optimizer divides the observed gradients by: loss scale and clipping together."""
        self.applied_divisor = float(divisor)

    def set_applied_divisor_of_norm(self, norm, formula: Callable[[float], float]) -> None:
        """The applied divisor as ``formula(float(norm))``, for the optimizer's global norm still on its device:
        ``finish`` reads it with the statistics, in the step's one host transfer, rather than each
        partition's read point forcing a host synchronisation of its own."""
        if isinstance(norm, torch.Tensor):
            self.divisor_of_norm = (norm, formula)
        else:
            self.set_applied_divisor(formula(norm))

    def set_clip_norm(self, max_norm: float, local_square: Optional[torch.Tensor] = None) -> None:
        """Clipping to ``max_norm`` as ``torch.nn.utils.clip_grad_norm_`` does it: the factor comes from
        the statistics' own total norm once they are reduced, with no extra read; or, where the caller
        clips by another norm, from the sum over the ranks of ``local_square``, this rank's share of that
        norm's square, which rides in the status row of the statistics' own SUM all-reduce."""
        self.clip_norm = max_norm
        self.clip_square = local_square

    def local_table(self) -> torch.Tensor:
        """This rank's table and, as its last row, a status row whose element count flags a step this rank
        failed to measure or left incomplete (it survives any reduction, as a count does), whose squared
        norm carries this rank's share of the norm the caller clips by (``set_clip_norm``), if any, and whose
        max and -min carry the step (reduced, the highest and the lowest step of the ranks). Written in place:
        the buffer itself, valid until the owner's next step."""
        complete = not self.failed and len(self.observed) == self.num_partitions
        status = self.table[-1].zero_()
        status[NUMEL] = 0.0 if complete else 1.0
        status[MAX], status[NEG_MIN] = self.step, -self.step
        if self.clip_square is not None:
            status[SUMSQ] = self.clip_square
        return self.table

    def scales(self, overflow: bool) -> StepScales:
        """What the step's result needs beside its reduced table."""
        return StepScales(self.step,
                          bool(overflow),
                          self.gradient_scale,
                          self.applied_divisor,
                          self.clip_norm,
                          self.divisor_of_norm,
                          clip_by_status=self.clip_square is not None,
                          kinds=self.kinds,
                          action=self.action)

    def finish(self, process_group, overflow: bool, keys: Sequence[Hashable],
               selected: Sequence[Hashable]) -> Optional[dict]:
        """Reduce the step across ``process_group`` (``reduce_stats``; every rank must call it) and return the
        result of the ``selected`` buckets; ``None`` when any rank failed to measure.

        ``overflow``: the loss scaler skipped the step; pre-clip statistics only.
        """
        self.finished = True
        if self.reduced is not None:
            stats, scales = self.reduced, resolve_scales([self.scales(overflow)])
        else:
            stats, scales = host_copy(reduce_stats(self.local_table(), process_group), [self.scales(overflow)])
        return step_result(stats, scales[0], keys, selected, self.extra)

    def reduce_now(self, process_group) -> Optional[torch.Tensor]:
        """Reduce the gradient observed so far across ``process_group`` before the optimizer steps (every rank
        must call it), for the remedies to act on: the host table, kept for ``finish``, which then issues no
        collective; ``None`` when a rank failed to measure the step (the status row says so)."""
        self.reduced = reduce_stats(self.local_table(), process_group).cpu()
        return None if self.reduced[-1, NUMEL] > 0 else self.reduced
