# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The flight recorder: every optimizer step's local statistics, kept for the last K steps.

A spike is seen only once its step is over, and the steps before it are often the ones worth seeing. With
``trigger.history: K`` every step's measurement is pushed here unreduced: this rank's table (the gradient's
buckets, a block of buckets per ``optimizer_statistics`` kind, the status row last) stays on the device, in one
preallocated ring of K tables written in place, beside the step's scales. A quiet step adds no collective and no
host copy. When the trigger fires, every rank reduces the whole ring in one reduction (that of one measured
step), and each recorded step becomes a result shaped like ``get_layer_grad_norms()``, every bucket.
"""

import math
from dataclasses import dataclass, field, replace
from typing import Collection, Hashable, List, Optional, Sequence, Tuple

import torch

from .measurement import StepScales, host_copy, step_result, table_rows
from .reduction import reduce_stats
from .statistics import MAX, NEG_MIN, NUM_COLUMNS, NUMEL, empty_stats


@dataclass
class Replay:
    """The recorded steps as every rank reduced them at a fire (the same on every rank)."""

    results: List[dict] = field(default_factory=list)
    """Each step's result, oldest first, all buckets."""
    failed: List[int] = field(default_factory=list)
    """Steps a rank could not measure (the status row's failure flag): no result."""
    disagreeing: List[Tuple[float, float]] = field(default_factory=list)
    """Slots of the ring in which the ranks recorded different steps, as (lowest, highest) step (``inf`` and
    ``-inf`` where a rank recorded nothing): a rank that missed a push. No result."""


class FlightRecorder:
    """A ring of the last ``capacity`` steps' local tables (on the device) and their scales."""

    def __init__(self, capacity: int, num_rows: int, device, kinds: Sequence[str] = ()) -> None:
        """``num_rows``: the buckets of the layer map; ``kinds``: the optimizer statistics each step carries
        (one block of buckets each; the status row is added here)."""
        rows = table_rows(num_rows, kinds)
        self.tables = empty_stats(capacity * rows, device).view(capacity, rows, NUM_COLUMNS)
        self.scales: List[Optional[StepScales]] = [None] * capacity
        self.norms = torch.zeros(capacity, dtype=torch.float64, device=device)
        """Each slot's copy of the optimizer's global norm, where its scales read one (``scale_of_norm``)."""
        self.next_slot = 0

    @property
    def nbytes(self) -> int:
        """The ring's device memory: capacity x (buckets x (1 + kinds) + 1) x 9 float64."""
        return self.tables.numel() * self.tables.element_size()

    def push(self, table: torch.Tensor, scales: StepScales) -> None:
        """Record one step: its local table with its status row (``Measurement.local_table``, which carries
        the step number), and its scales; the oldest step drops out of a full ring. Device copies into the ring,
        no host synchronisation, no allocation."""
        self.tables[self.next_slot].copy_(table)
        if scales.scale_of_norm is not None:  # the optimizer's norm tensor is its own: keep a copy
            norm, formula = scales.scale_of_norm
            kept = self.norms[self.next_slot]
            kept.copy_(norm.detach().reshape(()))
            scales = replace(scales, scale_of_norm=(kept, formula))
        self.scales[self.next_slot] = scales
        self.next_slot = (self.next_slot + 1) % self.tables.shape[0]

    def history(self, group, keys: Sequence[Hashable], extra: Collection[str], after: int = 0) -> Replay:
        """The recorded steps after step ``after``, all buckets: the whole ring reduced across ``group`` in one
        reduction (every rank must call it). Each slot's status row carries the step in a maximum column and
        its negation in another, so the reduction gives every rank the highest and the lowest step the ranks
        recorded there: a slot where they differ, or that a rank flagged as failed, gives no result."""
        filled = [slot for slot, scales in enumerate(self.scales) if scales is not None]
        reduced, resolved = host_copy(reduce_stats(self.tables.view(-1, NUM_COLUMNS), group),
                                      [self.scales[slot] for slot in filled])
        reduced = reduced.view(self.tables.shape)
        scales_of = dict(zip(filled, resolved))
        replay = Replay()
        for slot, status in enumerate(reduced[:, -1].tolist()):
            highest, neg_lowest, flag = status[MAX], status[NEG_MIN], status[NUMEL]
            if highest == -math.inf:
                continue  # no rank recorded anything there yet
            if highest != -neg_lowest:
                replay.disagreeing.append((-neg_lowest, highest))
            elif highest > after and flag > 0:
                replay.failed.append(int(highest))
            elif highest > after:
                replay.results.append(step_result(reduced[slot], scales_of[slot], keys, keys, extra))
        replay.results.sort(key=lambda result: result["step"])
        replay.failed.sort()
        replay.disagreeing.sort()
        return replay
