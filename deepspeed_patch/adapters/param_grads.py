# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Gradients in each parameter's ``.grad``, complete and averaged on every rank: DeepSpeed without ZeRO
in fp32 (the engine clips them itself), plain PyTorch and DistributedDataParallel (``plain.py``).

They are read when the step begins, before anything clips them; no collective is needed, except under
pipeline or tensor parallelism, where each rank holds its stage's or shard's gradient: the tables are
summed over the model-parallel group, and the engine clips by DeepSpeed's model-parallel norm
(``clipping.engine_fp32_clip_square``: each rank's share rides in the same reduction). The engine keeps
no global norm here; with a flight recorder (``trigger.history``) every step is read, and the trigger gets
the global norm from that table (the whole model on every rank), with the one host sync it needs anyway.
"""

from typing import Callable, List, Optional

import torch

from ..optimizer_state.optimizer_stats import parameter_statistics
from ..statistics.measurement import Measurement
from ..statistics.statistics import SUMSQ
from .base import LayerGradNormsAdapter, Setup


class ParamGradAdapter(LayerGradNormsAdapter):
    """Reads the ``.grad`` of every measured parameter."""

    def __init__(self,
                 params: List[torch.nn.Parameter],
                 setup: Setup,
                 max_norm: Optional[Callable[[], float]] = None,
                 clip_square: Optional[Callable[[], torch.Tensor]] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """``max_norm()``: the norm the caller clips to after the measurement (0: no clipping); the
        post-clip statistics follow ``torch.nn.utils.clip_grad_norm_``. Without it, the caller sets the
        measurement's applied divisor itself. ``clip_square()``: this rank's share of the square of the
        global norm the caller clips by, where that is not the statistics' own total norm (DeepSpeed's rule
        under pipeline or tensor parallelism). ``optimizer``: the torch optimizer that steps ``params``, whose
        state the ``optimizer_statistics`` read (DeepSpeed's ``engine.optimizer`` without ZeRO in fp32)."""
        self.measured = [param for param in params if setup.bucket_of(param) is not None]
        self.bucket_of = setup.bucket_of
        self.max_norm = max_norm
        self.clip_square = clip_square
        self.norm: Optional[torch.Tensor] = None
        self._buckets_of: List[torch.nn.Parameter] = []
        self._bucket_rows = torch.zeros(0, dtype=torch.int64)
        super().__init__(setup, 1, params[0].device)
        if optimizer is not None:
            rows = {param: setup.bucket_of(param) for param in self.measured}
            buckets = [[rows.get(param) for param in group["params"]] for group in optimizer.param_groups]
            self.optimizer_statistics = parameter_statistics(optimizer, buckets, self.kinds)

    def read_at_begin(self, measurement: Measurement) -> None:
        with_grad = [param for param in self.measured if param.grad is not None]
        measurement.observe(0, [param.grad.detach().reshape(-1) for param in with_grad], self._buckets(with_grad))
        max_norm = self.max_norm() if self.max_norm is not None else 0.0
        if max_norm > 0:
            measurement.set_clip_norm(max_norm, None if self.clip_square is None else self.clip_square())

    def _buckets(self, with_grad: List[torch.nn.Parameter]) -> torch.Tensor:
        """The bucket rows of ``with_grad`` on the device, made once for each set of parameters with a gradient
        (the same every step, unless a parameter's gradient comes and goes)."""
        if self._buckets_of != with_grad:
            rows = [self.bucket_of(param) for param in with_grad]
            self._buckets_of, self._bucket_rows = with_grad, torch.tensor(rows, dtype=torch.int64, device=self.device)
        return self._bucket_rows

    def read_at_end(self, measurement: Measurement, overflow: bool) -> None:
        if self.recording():
            self.norm = measurement.stats[:, SUMSQ].sum().sqrt()

    def global_norm(self) -> Optional[torch.Tensor]:
        """The norm of the step just read by the recorder, on the device: the trigger's one host read is the
        step's only one (taken once: a step it did not read has none)."""
        norm, self.norm = self.norm, None
        return norm
