# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The flight recorder: every optimizer step's local statistics, kept for the last K steps.

A spike is seen only once its step is over, and the steps before it are often the ones worth seeing. With
``trigger.history: K`` every step's measurement is pushed here unreduced: this rank's table (the gradient's
buckets, a block of buckets per ``optimizer_statistics`` kind, the status row last) stays on the device, in one
preallocated ring of K tables written in place, beside the step's scales. A quiet step adds no collective and no
host copy. When the trigger fires, every rank reduces the whole ring in one reduction (that of one measured
step), and each recorded step becomes a result shaped like ``get_layer_grad_norms()``, every bucket. A step that
leaves the ring is folded into a block of K steps, and the last ``BEFORE_BLOCKS`` blocks are kept beside the ring:
the level before the recorded steps, each block reduced with the ring and read as its steps' root mean square.
"""

import math
from dataclasses import dataclass, field, replace
from typing import Collection, Hashable, List, Optional, Sequence, Tuple

import torch

from ..statistics.reduction import reduce_stats
from ..statistics.result import StepScales, host_copy, step_result
from ..statistics.statistics import (
    L1,
    MAX,
    NEG_MIN,
    NONFINITE,
    NUM_COLUMNS,
    NUM_SUMMED,
    NUMEL,
    SUM,
    SUMSQ,
    ZEROS,
    empty_stats,
    reset_stats,
    table_rows,
)

BEFORE_BLOCKS = 8
"""Blocks of K steps kept before the ring (``FlightRecorder``): the level of each signal over the 8 K steps before
the recorded steps, 8 x (buckets x (1 + kinds) + 1) x 72 bytes more on the device."""


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
    before: List[dict] = field(default_factory=list)
    """The blocks of steps that left the ring before the recorded steps, oldest first: ``{"steps": [first, last],
    "pre_clip": {bucket: {"norm", "nonfinite"}}, kind: {...}}``, each norm the root mean square over the block's
    steps (``FlightRecorder``); a block a rank failed or on which the ranks disagree is left out."""


class FlightRecorder:
    """A ring of the last ``capacity`` steps' local tables (on the device) and their scales."""

    def __init__(self, capacity: int, num_rows: int, device, kinds: Sequence[str] = ()) -> None:
        """``num_rows``: the buckets of the layer map; ``kinds``: the optimizer statistics each step carries
        (one block of buckets each; the status row is added here)."""
        rows = table_rows(num_rows, kinds)
        self.num_rows, self.kinds = num_rows, tuple(kinds)
        storage = empty_stats((capacity + BEFORE_BLOCKS) * rows, device).view(-1, rows, NUM_COLUMNS)
        self.storage = storage.view(-1, NUM_COLUMNS)
        """The ring and the blocks before it, one tensor: a fire reduces both in one reduction."""
        self.tables, self.blocks = storage[:capacity], storage[capacity:]
        self.block_steps: List[List[int]] = [[] for _ in range(BEFORE_BLOCKS)]
        """The steps this rank folded into each block (its first and last, and how many, close it)."""
        self.block_finite = [0] * BEFORE_BLOCKS
        """How many of each block's steps were not overflowed: its norms' mean is over those (the same on every
        rank: the overflow is the optimizer's, agreed by all ranks)."""
        self.open_block = 0
        self.scales: List[Optional[StepScales]] = [None] * capacity
        self.norms = torch.zeros(capacity, dtype=torch.float64, device=device)
        """Each slot's copy of the optimizer's global norm, where its scales read one (``divisor_of_norm``)."""
        self.next_slot = 0

    @property
    def nbytes(self) -> int:
        """The ring's device memory, with its blocks: (capacity + ``BEFORE_BLOCKS``) x (buckets x (1 + kinds) + 1)
        x 9 float64."""
        return self.storage.numel() * self.storage.element_size()

    def push(self, table: torch.Tensor, scales: StepScales) -> None:
        """Record one step: its local table with its status row (``Measurement.local_table``, which carries
        the step number), and its scales; the oldest step drops out of a full ring. Device copies into the ring,
        no host synchronisation, no allocation."""
        leaving = self.scales[self.next_slot]
        if leaving is not None:
            self._fold(self.tables[self.next_slot], leaving)
        self.tables[self.next_slot].copy_(table)
        if leaving is not None:
            self.block_steps[self.open_block].append(leaving.step)
            self.block_finite[self.open_block] += not leaving.overflow
        if scales.divisor_of_norm is not None:  # the optimizer's norm tensor is its own: keep a copy
            norm, formula = scales.divisor_of_norm
            kept = self.norms[self.next_slot]
            kept.copy_(norm.detach().reshape(()))
            scales = replace(scales, divisor_of_norm=(kept, formula))
        self.scales[self.next_slot] = scales
        self.next_slot = (self.next_slot + 1) % self.tables.shape[0]

    def _fold(self, table: torch.Tensor, scales: StepScales) -> None:
        """Add a step leaving the ring to the open block (a new one after K steps): its squared norms, the
        gradient's unscaled, its non-finite and element counts, its failure flag, and its step into the block's
        range; of an overflowed step, its failure flag and its step only. Device operations in place, as
        ``push``'s."""
        if len(self.block_steps[self.open_block]) == self.tables.shape[0]:
            self.open_block = (self.open_block + 1) % BEFORE_BLOCKS
            self.block_steps[self.open_block] = []
            self.block_finite[self.open_block] = 0
            reset_stats(self.blocks[self.open_block])
        block, gradient = self.blocks[self.open_block], slice(0, self.num_rows)
        if not scales.overflow:
            block[gradient, SUMSQ].add_(table[gradient, SUMSQ], alpha=1.0 / scales.gradient_scale**2)
            block[self.num_rows:-1, SUMSQ].add_(table[self.num_rows:-1, SUMSQ])
            block[:, NONFINITE].add_(table[:, NONFINITE])
        block[:, NUMEL].add_(table[:, NUMEL])  # the buckets' element counts, and the status row's failure flag
        torch.maximum(block[-1, NUM_SUMMED:], table[-1, NUM_SUMMED:], out=block[-1, NUM_SUMMED:])

    def replay(self, process_group, keys: Sequence[Hashable], extra: Collection[str], after: int = 0) -> Replay:
        """The recorded steps after step ``after``, all buckets: the whole ring reduced across ``process_group`` in one
        reduction (every rank must call it). Each slot's status row carries the step in a maximum column and
        its negation in another, so the reduction gives every rank the highest and the lowest step the ranks
        recorded there: a slot where they differ, or that a rank flagged as failed, gives no result."""
        filled = [slot for slot, scales in enumerate(self.scales) if scales is not None]
        self._stamp_blocks()
        reduced, resolved = host_copy(reduce_stats(self.storage, process_group),
                                      [self.scales[slot] for slot in filled])
        reduced, blocks = reduced.view(-1, *self.tables.shape[1:]).split([self.tables.shape[0], BEFORE_BLOCKS])
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
        replay.before = self._blocks(blocks, keys)
        if replay.results and replay.before:
            replay.results[0]["before"] = replay.before
        return replay

    def _stamp_blocks(self) -> None:
        """Each block's status row, before a fire's reduction: this rank's first and last step there (0 where it
        has none), summed over the ranks, and a 1 per rank. Against the reduced lowest first and highest last step
        (the maxima, folded step by step), they tell every rank alike whether all ranks hold the same steps there."""
        stamps = [[steps[0], steps[-1], 1.0] if steps else [0.0, 0.0, 1.0] for steps in self.block_steps]
        self.blocks[:, -1, L1:NUMEL].copy_(torch.tensor(stamps, dtype=torch.float64))

    def _blocks(self, reduced: torch.Tensor, keys: Sequence[Hashable]) -> List[dict]:
        """The reduced blocks (``Replay.before``), oldest first: those all ranks hold with the same first and last
        step, and no rank failed a step of; each norm the root mean square over its steps."""
        found = []
        for offset in range(1, BEFORE_BLOCKS + 1):
            index = (self.open_block + offset) % BEFORE_BLOCKS
            status = reduced[index, -1].tolist()
            first, last, ranks = -status[NEG_MIN], status[MAX], status[ZEROS]
            same = status[L1] == ranks * first and status[SUM] == ranks * last
            if last == -math.inf or not same or status[NUMEL] > 0:
                continue  # empty, a rank missed a push, or a rank failed a step there
            rows = reduced[index, :-1].view(1 + len(self.kinds), self.num_rows, NUM_COLUMNS)
            block, count = {"steps": [int(first), int(last)]}, self.block_finite[index]
            for kind, table in zip(("pre_clip", ) + self.kinds, rows):
                block[kind] = {
                    key: {
                        "norm": math.sqrt(row[SUMSQ] / count) if count else math.nan,
                        "nonfinite": int(row[NONFINITE])
                    }
                    for key, row in zip(keys, table.tolist()) if row[NUMEL] > 0
                }
            found.append(block)
        return found
