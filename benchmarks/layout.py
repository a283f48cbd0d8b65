"""A rank's flat gradient partition of a TinyGPT, laid out as ZeRO-1/2 lays it out, without DeepSpeed.

The statistics-alone benchmarks use it: the real layer map (``build_layer_map``) and partition runs
(``partition_spans``) of the package over a random fp32 partition, so that scaling to 96 layers needs
neither a training run nor the memory of the model (built on the ``meta`` device).
"""

from dataclasses import dataclass
from typing import List

import torch

from deepspeed_patch.statistics.layer_map import build_layer_map
from deepspeed_patch.statistics.partition_slices import (
    PartitionSlices,
    back_to_back_ranges,
    partition_spans,
    slices_of_spans,
)
from megatron_integration.tiny_gpt import TinyGPT, TinyGPTConfig


@dataclass
class Partition:
    flat: torch.Tensor
    """This rank's flat fp32 gradient partition (random values)."""
    slices: PartitionSlices
    num_buckets: int
    num_params: int
    """Parameters of the whole model."""
    param_views: List[torch.Tensor]
    """One view per parameter (part) in the partition: what DeepSpeed's own norm computation reads."""

    @property
    def runs(self) -> List[torch.Tensor]:
        return self.slices.views(self.flat)


def gpt_config(num_layers: int, hidden: int) -> TinyGPTConfig:
    return TinyGPTConfig(vocab_size=1024, seq_len=64, hidden=hidden, num_layers=num_layers, num_heads=4)


def tiny_gpt_partition(num_layers: int, hidden: int, world_size: int = 2, rank: int = 0,
                       granularity: str = "layer", seed: int = 0) -> Partition:
    """Rank ``rank``'s partition: the parameters back to back in model order, cut in ``world_size``
    equal parts (one parameter group, no round-robin reordering: DeepSpeed's defaults)."""
    with torch.device("meta"):
        model = TinyGPT(gpt_config(num_layers, hidden))
    named = list(model.named_parameters())
    layer_map = build_layer_map(named, [name for name, _ in named], granularity=granularity)
    ranges = back_to_back_ranges([param for _, param in named], layer_map.bucket_of)
    offset = sum(numel for _, numel, _ in ranges)
    size = -(-offset // world_size)
    start = rank * size
    slices = slices_of_spans(partition_spans(ranges, start, min(size, offset - start)))
    flat = torch.randn(size, generator=torch.Generator().manual_seed(seed))
    param_runs = partition_spans([(begin, numel, index) for index, (begin, numel, _) in enumerate(ranges)], start,
                                min(size, offset - start))
    return Partition(flat=flat, slices=slices, num_buckets=len(layer_map.keys), num_params=offset,
                     param_views=[flat.narrow(0, begin, length) for begin, length, _ in param_runs])
