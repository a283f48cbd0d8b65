# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Per-bucket adaptive gradient clipping: AdaGC's rule (Wang et al., arXiv 2502.11034) on the reduced norms.

Each bucket (a layer, or a parameter with ``granularity: "param"``) keeps ``ema``, a moving average of its own
clipped gradient norm. For the first ``warmup_steps`` applied steps DeepSpeed clips the global norm as configured
and ``ema`` holds the smallest clipped norm the bucket has had (AdaGC's warm-up, which starts the average low
rather than at a noisy early value). From then on global clipping is replaced: each bucket's gradient is
multiplied by ``min(1, factor * ema / norm)`` and ``ema`` moves to ``beta * ema + (1 - beta) * clipped_norm``.

Everything here works on the host, on the per-bucket norms the step's reduction gave every rank (the same bits
on every rank), so every rank computes the same factors and the same state. A bucket with no gradient (norm 0)
or a non-finite one keeps its ``ema``. A bucket that has had no usable norm yet (an expert not routed in the
warm-up) is clipped as the warm-up clips, by the global coefficient, until it has one; its ``ema`` starts there.
"""

import logging
import math
from typing import Hashable, Optional, Sequence

import torch

from ..config import AdaptiveClippingConfig

logger = logging.getLogger(__name__)


class AdaptiveClipping:
    """AdaGC's factors and state for one optimizer's buckets."""

    def __init__(self, config: AdaptiveClippingConfig, keys: Sequence[Hashable]) -> None:
        self.beta, self.relative_limit, self.warmup_steps = config.beta, config.factor, config.warmup_steps
        """``relative_limit``: AdaGC's lambda (the ds_config's ``factor``): a bucket whose norm passes it times the
        bucket's average is clipped to that."""
        self.keys = list(keys)
        self.ema = torch.full((len(self.keys), ), math.inf, dtype=torch.float64)
        """Each bucket's moving average of its clipped norm (``inf``: none yet)."""
        self.steps = 0
        """Applied optimizer steps seen (skipped and overflowed steps do not count)."""

    def warming_up(self) -> bool:
        """Whether DeepSpeed's global clipping still applies (the first ``warmup_steps`` applied steps)."""
        return self.steps < self.warmup_steps

    def factors(self, norms: torch.Tensor, global_coefficient: float) -> Optional[torch.Tensor]:
        """Each bucket's multiplier for a step whose pre-clip norms are ``norms`` (float64, host, unscaled);
        ``None`` in the warm-up. A bucket without an average yet gets ``global_coefficient``, what global clipping
        would multiply the step's gradient by: no bucket passes unclipped because it had no usable norm before."""
        if self.warming_up():
            return None
        limit = self.relative_limit * self.ema
        clipped = torch.isfinite(norms) & (norms > limit)
        factors = torch.where(clipped, limit / norms, torch.ones_like(norms))
        return torch.where(torch.isinf(self.ema), torch.full_like(norms, global_coefficient), factors)

    def update(self, clipped_norms: torch.Tensor) -> None:
        """An applied step's clipped norms join each bucket's average (the warm-up's minimum before)."""
        usable = torch.isfinite(clipped_norms) & (clipped_norms > 0)
        if self.warming_up():
            moved = torch.minimum(self.ema, clipped_norms)
        else:
            first = torch.isinf(self.ema)
            moved = torch.where(first, clipped_norms, self.beta * self.ema + (1 - self.beta) * clipped_norms)
        self.ema = torch.where(usable, moved, self.ema)
        self.steps += 1

    def state_dict(self) -> dict:
        """The state a checkpoint keeps: each bucket's average by its key, and the steps seen."""
        return {"steps": self.steps, "ema": dict(zip(self.keys, self.ema.tolist()))}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s state; a bucket the checkpoint lacks starts afresh (logged)."""
        saved = state["ema"]
        missing = [key for key in self.keys if key not in saved]
        if missing:
            logger.warning(
                "layer_grad_norms: adaptive_clipping: the checkpoint has no average for buckets %s; "
                "they start afresh", missing[:5])
        self.ema = torch.tensor([saved.get(key, math.inf) for key in self.keys], dtype=torch.float64)
        self.steps = int(state["steps"])
