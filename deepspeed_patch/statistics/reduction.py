# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The reduction of every rank's ``(buckets, 9)`` statistics table: two all-reduces, whatever the world size.

The first ``NUM_SUMMED`` columns add up across ranks and the others take the maximum, so one SUM and one MAX
all-reduce give every rank the same bits of the full gradient's statistics. NaN and +inf in the maxima are coded
as finite values first, so that the result depends neither on the backend nor on the rank that holds them.
The loss the training loop reports is combined here too (``LossAgreement``).
"""

import math
from typing import List, Optional, Sequence, Tuple, Union

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


class LossAgreement:
    """The losses this rank reported since they were last agreed, one slot per reader (``ReportedLoss``), agreed over
    ``process_group`` (the adapter's) at most once a step: the first reader to ask at a step agrees every slot in
    one all-reduce (``agreed_losses``), and a later reader at that step reads its own slot of it."""

    def __init__(self, process_group: object = None) -> None:
        self.process_group = process_group
        self.values: List[Union[None, float, torch.Tensor]] = []
        """Each reader's loss reported since the last agreement, ``None`` where none was."""
        self.agreed: Optional[Tuple[int, List[Union[None, float, torch.Tensor]]]] = None
        """The step of the last agreement and its result, each slot's, the same on every rank; its tensor is
        referenced until the next agreement (``_LAST_REDUCED`` says why)."""

    def reader(self) -> "ReportedLoss":
        """A new reader, with its own slot (at start-up: every rank adds the same readers, in the same order)."""
        self.values.append(None)
        return ReportedLoss(self, len(self.values) - 1)

    def agree(self, step: int) -> List[Union[None, float, torch.Tensor]]:
        """Every slot's loss agreed at ``step``: one MAX all-reduce the first time a reader asks at this step, whatever
        the other readers do; the ranks' own losses are then dropped."""
        if self.agreed is None or self.agreed[0] != step:
            values, self.values = self.values, [None] * len(self.values)
            self.agreed = step, agreed_losses(values, self.process_group)
        return self.agreed[1]


class ReportedLoss:
    """One reader's loss: what this rank reported since the reader last judged one, agreed with every other
    reader's slot of its ``LossAgreement``."""

    def __init__(self, agreement: LossAgreement, slot: int) -> None:
        self.agreement = agreement
        self.slot = slot

    def report(self, loss: Union[float, torch.Tensor]) -> None:
        """Keep ``loss`` as it is: a device tensor is read with the step's other values, in one host copy."""
        self.agreement.values[self.slot] = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)

    def agree(self, step: int) -> Union[None, float, torch.Tensor]:
        """The largest loss any rank reported to this reader before ``step`` was agreed, the same on each."""
        return self.agreement.agree(step)[self.slot]

    def drop(self) -> None:
        """Forget the reported loss unjudged (a step the loss scaler skipped)."""
        self.agreement.values[self.slot] = None


def agreed_losses(losses: Sequence[Union[None, float, torch.Tensor]],
                  process_group: object = None) -> List[Union[None, float, torch.Tensor]]:
    """The largest of each slot of ``losses`` any rank of ``process_group`` reported, the same on each, on the device:
    one MAX all-reduce of one float64 a slot on every step the loss is watched, whether this rank reported one or not
    (``-inf``: none), so ranks reporting their own losses, or some none, decide together. A non-finite loss travels
    as ``reduction``'s codes (NaN over +inf) and fires on every rank. ``process_group`` is the one the failure latch
    spreads over (``steps.FailureLatch``): ranks that stop measuring stop this all-reduce at the same step; under
    pipeline parallelism it holds every stage. ``REPLICATED``, or one process: the losses as this rank has them."""
    if process_group is REPLICATED or not dist.is_initialized() or dist.get_world_size(group=process_group) == 1:
        return list(losses)
    device = get_accelerator().current_device_name()
    values = torch.cat([_coded(loss, device) for loss in losses])
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=process_group)
    decode_maxima(values)
    return [values[slot:slot + 1] for slot in range(len(losses))]


def _coded(loss: Union[None, float, torch.Tensor], device) -> torch.Tensor:
    """One slot of ``agreed_losses``' all-reduce: the loss in float64, non-finite values coded; ``-inf``: none."""
    if loss is None:
        return torch.full((1, ), -math.inf, dtype=torch.float64, device=device)
    value = loss.reshape(1).double().to(device) if isinstance(loss, torch.Tensor) else \
        torch.tensor([loss], dtype=torch.float64, device=device)
    return value.nan_to_num(nan=NAN_CODE, posinf=INF_CODE, neginf=NAN_CODE)


def reported_loss(agreed: Union[None, float, torch.Tensor]) -> Optional[float]:
    """An ``agreed_losses`` slot's value on the host: ``None`` where no rank reported a loss (its ``-inf``)."""
    value = None if agreed is None else float(agreed)
    return None if value == -math.inf else value
