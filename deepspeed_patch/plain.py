# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The same per-layer statistics for a plain PyTorch or DistributedDataParallel training loop.

``param.grad`` already holds the full, averaged gradient on every rank there, so no collective is
needed: the statistics come from the same layer map, the same one-pass computation and the same
result format as under ZeRO. A Hugging Face or Lightning callback can call it in a few lines
(see the README).
"""

from typing import Any, Callable, List, Optional

import torch
from torch import nn

from .config import CONFIG_KEY, LayerGradNormsConfigError, load_config
from .layer_map import build_layer_map
from .statistics import REPLICATED
from .tracker import LayerGradNormTracker


class LayerGradNorms:
    """Per-layer gradient statistics of ``model`` (an ``nn.Module`` or a ``DistributedDataParallel``).

    ``options`` are the keys of the ds_config block (``layers``, ``interval``, ``layer_pattern``,
    ``granularity``, ``group_by``, ``statistics``, ``control_file``, ``dump``), validated the same
    way; ``trigger`` is refused (no optimizer here reports the global norm). Call ``measure()`` or
    ``clip_grad_norm_()`` once per optimizer step, after ``backward()`` (and after unscaling, with AMP).
    """

    def __init__(self, model: nn.Module, completed_steps: Optional[Callable[[], int]] = None, **options: Any) -> None:
        """``completed_steps()``: the optimizer steps so far, if something else counts them (DeepSpeed's
        engine); by default this object counts its own calls."""
        config = load_config({CONFIG_KEY: {"enabled": True, **options}})
        if config.trigger is not None:
            raise LayerGradNormsConfigError(f"{CONFIG_KEY}.trigger={options['trigger']!r}: needs DeepSpeed's "
                                            "ZeRO-1/2, BF16 or fp16 optimizer, which report the global norm")
        module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        named = list(module.named_parameters())
        trainable = [(name, param) for name, param in named if param.requires_grad]
        layer_map = build_layer_map(trainable, [name for name, _ in named], config.layer_pattern, config.granularity,
                                    config.group_by)
        self.trainable = [param for _, param in trainable]
        self._measured = [param for param in self.trainable if layer_map.bucket_of(param) is not None]
        self._steps = 0
        device = self.trainable[0].device
        self._bucket_of = {id(param): layer_map.bucket_of(param) for param in self._measured}
        self.tracker = LayerGradNormTracker(config,
                                            layer_map, [None],
                                            REPLICATED,
                                            device,
                                            completed_steps=completed_steps or (lambda: self._steps))

    def measure(self, clip_coef: float = 1.0) -> Optional[dict]:
        """The statistics of the current gradients, or ``None`` off the interval.

        ``clip_coef`` is the factor you are about to multiply the gradients by (post-clip statistics).
        """
        return self._step(lambda: self.tracker.set_applied_scale(1.0 / clip_coef))

    def clip_grad_norm_(self, max_norm: float) -> Optional[dict]:
        """Measure, then clip every trainable gradient like ``torch.nn.utils.clip_grad_norm_``."""
        result = self._step(lambda: self.tracker.set_clip_norm(max_norm))
        torch.nn.utils.clip_grad_norm_(self.trainable, max_norm)
        return result

    def measure_before_clipping(self, max_norm: float) -> Optional[dict]:
        """Measure gradients that the caller then clips to ``max_norm`` (0: no clipping) itself."""
        if max_norm > 0:
            return self._step(lambda: self.tracker.set_clip_norm(max_norm))
        return self.measure()

    def _step(self, set_clipping) -> Optional[dict]:
        if not self.tracker.begin_step():
            self._steps += 1
            return None
        with_grad = [param for param in self._measured if param.grad is not None]
        buckets = torch.tensor([self._bucket_of[id(param)] for param in with_grad],
                               dtype=torch.int64,
                               device=self.tracker.device)
        self.tracker.observe_runs(0, lambda: self._flat_grads(with_grad), buckets)
        set_clipping()
        self.tracker.end_step(overflow=False)
        self._steps += 1
        return self.tracker.get()

    @staticmethod
    def _flat_grads(params: List[nn.Parameter]) -> List[torch.Tensor]:
        return [param.grad.detach().reshape(-1) for param in params]
