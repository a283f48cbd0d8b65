# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Which slice of this rank's flat gradient partition belongs to which bucket.

A parameter's gradient on this rank is the intersection of its range in its group's flat buffer with this rank's
partition; padding belongs to no slice. Each adapter supplies its parameter offsets and partition bounds.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

Span = Tuple[int, int, int]
"""``(start, length, bucket row)`` of a flat gradient: one bucket's parameters laid out together."""


@dataclass(frozen=True)
class PartitionSlices:
    """Contiguous spans of one group's local partition, each inside a single bucket."""

    starts: Tuple[int, ...]
    lengths: Tuple[int, ...]
    buckets: torch.Tensor
    """Bucket position of each span (int64, on the device the statistics are computed on)."""

    def views(self, flat_partition: torch.Tensor) -> List[torch.Tensor]:
        """Views of ``flat_partition`` for each span; no copy."""
        return [flat_partition.narrow(0, start, length) for start, length in zip(self.starts, self.lengths)]

    def chunked_views(self, chunks: Sequence[torch.Tensor]) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """Views of the spans, and their buckets, when the partition is held as ``chunks`` laid end to end
        (a rank's per-parameter gradient pieces before they are flattened); no copy. A span that crosses
        several chunks becomes several views of its bucket."""
        views, owners, chunk, chunk_start = [], [], 0, 0
        for index, (start, length) in enumerate(zip(self.starts, self.lengths)):
            end = start + length
            while start < end:
                while chunk_start + chunks[chunk].numel() <= start:
                    chunk_start += chunks[chunk].numel()
                    chunk += 1
                stop = min(end, chunk_start + chunks[chunk].numel())
                views.append(chunks[chunk].reshape(-1).narrow(0, start - chunk_start, stop - start))
                owners.append(index)
                start = stop
        return views, self.buckets[torch.tensor(owners, dtype=torch.int64, device=self.buckets.device)]


def partition_spans(param_ranges: Sequence[Tuple[int, int, Optional[int]]], partition_start: int,
                    partition_size: int) -> List[Span]:
    """Spans ``(local_start, length, bucket)`` of one partition.

    ``param_ranges`` holds ``(offset, numel, bucket)`` of each parameter in the flat group buffer;
    a bucket of ``None`` leaves the parameter out (another rank counts it). Neighbouring parameters
    of the same bucket with no padding between them form one span.
    """
    partition_end = partition_start + partition_size
    spans: List[Span] = []
    for offset, numel, bucket in param_ranges:
        start, end = max(offset, partition_start), min(offset + numel, partition_end)
        if bucket is None or start >= end:
            continue
        local_start = start - partition_start
        if spans and spans[-1][2] == bucket and spans[-1][0] + spans[-1][1] == local_start:
            last_start, last_length, _ = spans[-1]
            spans[-1] = (last_start, last_length + end - start, bucket)
        else:
            spans.append((local_start, end - start, bucket))
    return spans


def back_to_back_ranges(params, bucket_of) -> List[Tuple[int, int, Optional[int]]]:
    """``(offset, numel, bucket)`` of parameters laid out with no padding between them."""
    ranges, offset = [], 0
    for param in params:
        ranges.append((offset, param.numel(), bucket_of(param)))
        offset += param.numel()
    return ranges


def slices_of_spans(spans: List[Span], device=None) -> PartitionSlices:
    """The ``PartitionSlices`` of spans ``(local_start, length, bucket)``."""
    return PartitionSlices(starts=tuple(span[0] for span in spans),
                           lengths=tuple(span[1] for span in spans),
                           buckets=torch.tensor([span[2] for span in spans], dtype=torch.int64, device=device))
