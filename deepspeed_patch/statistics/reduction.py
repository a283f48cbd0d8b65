# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The reduction of every rank's ``(buckets, 9)`` statistics table: two all-reduces, whatever the world size.

A table's first ``NUM_SUMMED`` columns add up across ranks (squared norm, non-finite count, L1, sum,
zeros, element count), the others take the maximum (max, -min, -abs_min). So one SUM all-reduce of
the summed columns and one MAX all-reduce of the others give every rank the statistics of the full
gradient. Each rank sends and receives about ``2 * 72 * buckets`` bytes (ring algorithm), whatever the
world size, where an all-gather of the tables brought ``72 * buckets * world_size`` to each rank. The
all-gather is not kept for small worlds, although it is cheaper there while latency dominates (one
collective of ``W - 1`` ring steps against two of ``2 (W - 1)``): a second path chosen by world size would
make the bytes per rank depend on the world again and need its own tests, for a saving the cost model
shows to be small (``benchmarks/results/reduction_cost.md`` has the figures).

Every rank gets the same bits: an all-reduce leaves one result on all ranks (NCCL's ring and tree, and
gloo's, compute each element's sum once and copy it), so no rank can see a different order of float64
additions. The counts (element count, non-finite, zeros, and the status row's failure flag a caller
appends as an extra row) are whole numbers, exact in float64 up to 2**53.

NaN in the maxima (max, -min, -abs_min) follows one rule, whatever the number of ranks and whichever rank
holds it: a NaN anywhere in a bucket's gradient makes its min, max, abs_min and abs_max NaN, as they are on
one rank, where ``torch.amax`` propagates NaN; else +inf wins over every finite value. The backends do not
agree with that or with each other (gloo's MAX keeps or drops a NaN depending on the rank that holds it,
NCCL's drops it), so ``reduce_stats`` codes NaN and +inf as finite float64 values above any gradient
statistic's range before the MAX all-reduce (NaN above +inf above every finite value) and decodes them
after: the order, and with it the result, no longer depends on the backend or on the rank.

The loss the training loop reports is combined here too (``ReportedLoss``, ``agreed_loss``): one MAX all-reduce
of one float64, its non-finite values coded as the maxima's.
"""

import math
from typing import Optional, Union

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

from .statistics import NUM_SUMMED

# The process group of a measurement whose gradients are already complete and identical on every rank (plain
# PyTorch, DistributedDataParallel, DeepSpeed without ZeRO): nothing to combine.
REPLICATED = "replicated"
COLLECTIVES_PER_STEP = 2
"""What ``reduce_stats`` issues when there is something to combine: one SUM and one MAX all-reduce."""
INF_CODE = 1e300
"""+inf in the maxima during the MAX all-reduce: above any finite statistic of a gradient (float32's and
bf16's largest is 3.4e38; float64 gradients beyond 1e300 are not supported)."""
NAN_CODE = 1e306
"""NaN in the maxima during the MAX all-reduce: above ``INF_CODE``, so that NaN wins over +inf."""
_LAST_REDUCED = []
"""The tensors of the last all-reduces, referenced from Python until the next ones. torch's gloo worker
thread (``ProcessGroupGloo::runLoop``) drops its reference to a collective's tensors after the caller's
wait has returned; where it drops the last one of a tensor Python created, it takes the GIL to free the
Python object, and if the interpreter is exiting by then, Python ends the thread with ``pthread_exit``,
whose unwinding through a ``noexcept`` destructor aborts the process ("terminate called without an active
exception"). Held here, the worker's release of these is a count decrement: the last reference is Python's. That
spares these tensors only: a run whose all-reduced tensors are all held still aborts at exit now and then.
(``upstream/bug_reports/gloo_exit_abort.md``.)"""


def reduce_stats(stats: torch.Tensor, process_group=None) -> torch.Tensor:
    """Combine every rank's table in ``process_group`` (``None``: all ranks) with ``COLLECTIVES_PER_STEP``
    all-reduces of O(buckets) bytes each; the same result, bit for bit, on every rank."""
    if process_group is REPLICATED or not dist.is_initialized() or dist.get_world_size(group=process_group) == 1:
        return stats
    # Offloaded partitions live in host memory; the communication backend wants accelerator tensors.
    stats = stats.to(get_accelerator().current_device_name())
    summed = stats[:, :NUM_SUMMED].contiguous()
    maxima = stats[:, NUM_SUMMED:].nan_to_num(nan=NAN_CODE, posinf=INF_CODE, neginf=-math.inf)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=process_group)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=process_group)
    _LAST_REDUCED[:] = [summed, maxima]
    return torch.cat([summed, decode_maxima(maxima)], dim=1)


def decode_maxima(maxima: torch.Tensor) -> torch.Tensor:
    """The reduced maxima with NaN and +inf restored from their codes (in place)."""
    maxima.masked_fill_(maxima >= NAN_CODE, math.nan)
    return maxima.masked_fill_(maxima >= INF_CODE, math.inf)


class ReportedLoss:
    """The loss this rank reported since a step last read it; agreed over ``process_group``, the adapter's."""

    def __init__(self, process_group: object = None) -> None:
        self.process_group = process_group
        self.value: Union[None, float, torch.Tensor] = None

    def report(self, loss: Union[float, torch.Tensor]) -> None:
        """Keep ``loss`` as it is: a device tensor is read with the step's other values, in one host copy."""
        self.value = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)

    def agree(self) -> Union[None, float, torch.Tensor]:
        """The largest loss any rank reported (``agreed_loss``), the same on each; the rank's own is then dropped."""
        loss, self.value = self.value, None
        return agreed_loss(loss, self.process_group)

    def drop(self) -> None:
        """Forget the reported loss unjudged (a step the loss scaler skipped)."""
        self.value = None


def agreed_loss(loss: Union[None, float, torch.Tensor],
                process_group: object = None) -> Union[None, float, torch.Tensor]:
    """The largest loss any rank of ``process_group`` reported, the same on each, on the device: one MAX all-reduce
    of one float64 on every step the loss is watched, whether this rank reported one or not (``-inf``: none), so
    ranks reporting their own losses, or some none, decide together. A non-finite loss travels as ``reduction``'s
    codes (NaN over +inf) and fires on every rank. ``process_group`` is the one the failure latch spreads over
    (``steps.FailureLatch``): ranks that stop measuring stop this all-reduce at the same step; under pipeline
    parallelism it holds every stage. ``REPLICATED``, or one process: the loss as this rank reported it."""
    if process_group is REPLICATED or not dist.is_initialized() or dist.get_world_size(group=process_group) == 1:
        return loss
    device = get_accelerator().current_device_name()
    if loss is None:
        value = torch.full((1, ), -math.inf, dtype=torch.float64, device=device)
    else:
        value = loss.reshape(1).double().to(device) if isinstance(loss, torch.Tensor) else \
            torch.tensor([loss], dtype=torch.float64, device=device)
        value = value.nan_to_num(nan=NAN_CODE, posinf=INF_CODE, neginf=NAN_CODE)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=process_group)
    return decode_maxima(value)


def reported_loss(agreed: Union[None, float, torch.Tensor]) -> Optional[float]:
    """``agreed_loss``'s value on the host: ``None`` where no rank reported a loss (its ``-inf``)."""
    value = None if agreed is None else float(agreed)
    return None if value == -math.inf else value
