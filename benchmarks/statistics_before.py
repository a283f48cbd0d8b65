"""``accumulate_spans`` as it was before the issue-6 optimisation, kept to time it against the current one in one run.

Same results as ``deepspeed_patch.statistics.partition_stats.accumulate_spans`` up to float rounding: one
``_foreach_norm`` over whole runs, one ``aminmax`` per run, and ``|x|`` taken in freshly allocated
chunks of 4M elements for abs_min.
"""

from typing import Collection, Sequence

import torch

from deepspeed_patch.statistics.statistics import (
    L1,
    MAX,
    NEG_ABS_MIN,
    NEG_MIN,
    NONFINITE,
    NUM_COLUMNS,
    NUM_SUMMED,
    NUMEL,
    SUM,
    SUMSQ,
    ZEROS,
)

ABS_CHUNK = 1 << 22


def accumulate_spans(stats: torch.Tensor, runs: Sequence[torch.Tensor], buckets: torch.Tensor,
                    extra: Collection[str] = ()) -> None:
    if not runs:
        return
    per_run = torch.zeros((len(runs), NUM_COLUMNS), dtype=torch.float64, device=stats.device)
    per_run[:, SUMSQ] = torch.stack(torch._foreach_norm(runs, 2.0)).double().square()
    min_max = torch.stack([torch.stack(torch.aminmax(run)) for run in runs]).double()
    per_run[:, MAX], per_run[:, NEG_MIN] = min_max[:, 1], -min_max[:, 0]
    per_run[:, NEG_ABS_MIN] = -torch.stack([_abs_min(run) for run in runs]).double()
    per_run[:, NUMEL] = torch.tensor([run.numel() for run in runs], dtype=torch.float64)
    if "l1" in extra:
        per_run[:, L1] = torch.stack(torch._foreach_norm(runs, 1.0)).double()
    if "mean" in extra:
        per_run[:, SUM] = torch.stack([run.sum(dtype=torch.float64) for run in runs])
    if "zeros" in extra:
        per_run[:, ZEROS] = per_run[:, NUMEL] - torch.stack([torch.count_nonzero(run) for run in runs]).double()
    if not bool(torch.isfinite(min_max).all()):
        per_run[:, NONFINITE] = torch.stack([torch.count_nonzero(~torch.isfinite(run)) for run in runs]).double()
    index = buckets.unsqueeze(1).expand(-1, NUM_SUMMED)
    stats[:, :NUM_SUMMED].scatter_add_(0, index, per_run[:, :NUM_SUMMED])
    index = buckets.unsqueeze(1).expand(-1, NUM_COLUMNS - NUM_SUMMED)
    stats[:, NUM_SUMMED:].scatter_reduce_(0, index, per_run[:, NUM_SUMMED:], reduce="amax")


def _abs_min(run: torch.Tensor) -> torch.Tensor:
    return torch.stack([chunk.abs().amin() for chunk in run.split(ABS_CHUNK)]).amin()
