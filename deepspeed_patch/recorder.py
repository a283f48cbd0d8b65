# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The flight recorder: every optimizer step's local statistics, kept for the last K steps.

A spike is seen only once its step is over, and the steps before it are often the ones worth seeing. With
``trigger.history: K`` every step's measurement is pushed here unreduced: this rank's ``(buckets + 1, 9)``
table (the status row last) stays on the device, in one preallocated ring of K tables written in place,
beside the step's scales. A quiet step adds no collective and no host copy. When the trigger fires, every
rank reduces the whole ring in one reduction (that of one measured step), and each recorded step becomes a
result shaped like ``get_layer_grad_norms()``, every bucket.
"""

from collections import deque
from dataclasses import replace
from typing import Collection, Deque, Hashable, List, Sequence

import torch

from .measurement import StepScales, host_copy, step_result
from .reduction import reduce_stats
from .statistics import NUM_COLUMNS, empty_stats


class FlightRecorder:
    """A ring of the last ``capacity`` steps' local tables (on the device) and their scales."""

    def __init__(self, capacity: int, num_rows: int, device) -> None:
        """``num_rows``: the buckets of the layer map (the status row is added here)."""
        self.tables = empty_stats(capacity * (num_rows + 1), device).view(capacity, num_rows + 1, NUM_COLUMNS)
        self.scales: Deque[StepScales] = deque(maxlen=capacity)
        self.norms = torch.zeros(capacity, dtype=torch.float64, device=device)
        """Each slot's copy of the optimizer's global norm, where its scales read one (``scale_of_norm``)."""
        self.next_slot = 0

    @property
    def nbytes(self) -> int:
        """The ring's device memory: capacity x (buckets + 1) x 9 float64."""
        return self.tables.numel() * self.tables.element_size()

    def push(self, table: torch.Tensor, scales: StepScales) -> None:
        """Record one step: its local table with its status row (``Measurement.local_table``), and its
        scales; the oldest step drops out of a full ring. Device copies into the ring, no host
        synchronisation, no allocation."""
        self.tables[self.next_slot].copy_(table)
        if scales.scale_of_norm is not None:  # the optimizer's norm tensor is its own: keep a copy
            norm, formula = scales.scale_of_norm
            kept = self.norms[self.next_slot]
            kept.copy_(norm.detach().reshape(()))
            scales = replace(scales, scale_of_norm=(kept, formula))
        self.scales.append(scales)
        self.next_slot = (self.next_slot + 1) % self.tables.shape[0]

    def history(self, group, keys: Sequence[Hashable], extra: Collection[str]) -> List[dict]:
        """Every recorded step's result, oldest first, all buckets: the whole ring reduced across ``group``
        in one reduction (every rank must call it). A step any rank failed to measure gives no entry."""
        capacity = self.tables.shape[0]
        reduced, scales = host_copy(reduce_stats(self.tables.view(-1, NUM_COLUMNS), group), list(self.scales))
        reduced = reduced.view(self.tables.shape)
        oldest = (self.next_slot - len(scales)) % capacity
        results = (step_result(reduced[(oldest + age) % capacity], step_scales, keys, keys, extra)
                   for age, step_scales in enumerate(scales))
        return [result for result in results if result is not None]
