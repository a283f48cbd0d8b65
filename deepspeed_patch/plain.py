# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The same per-layer statistics for a plain PyTorch or DistributedDataParallel training loop.

``param.grad`` already holds the full, averaged gradient on every rank there, so no collective is
needed: the statistics come from the same layer map, the same one-pass computation and the same
result format as under ZeRO. A Hugging Face or Lightning callback can call it in a few lines
(see the README).
"""

from typing import Any, Callable, Optional

import torch
from torch import nn

from .adapters.base import Setup
from .adapters.param_grads import ParamGradAdapter
from .config import CONFIG_KEY, LayerGradNormsConfigError, load_config
from .statistics.layer_map import build_layer_map
from .statistics.measurement import Measurement
from .statistics.reduction import REPLICATED

REFUSED = {
    "trigger": "needs DeepSpeed's ZeRO-1/2, BF16 or fp16 optimizer, which report the global norm",
    "optimizer_statistics": "read inside DeepSpeed's optimizers; not in plain PyTorch",
    "adaptive_clipping": "acts inside DeepSpeed's ZeRO or BF16_Optimizer step; not in plain PyTorch (clip with "
    "clip_grad_norm_)",
    "skip_step": "skips DeepSpeed's ZeRO optimizer step; not in plain PyTorch",
}
"""The keys this class refuses when they ask for something, and why: each one given is named."""


def _asks_for(value: Any) -> bool:
    """Whether a key's value asks for something: a trigger, statistics, an enabled remedy."""
    return bool(getattr(value, "enabled", value))


class LayerGradNorms:
    """Per-layer gradient statistics of ``model`` (an ``nn.Module`` or a ``DistributedDataParallel``).

    ``options`` are the keys of the ds_config block (``layers``, ``interval``, ``layer_pattern``,
    ``granularity``, ``group_by``, ``statistics``, ``control_file``, ``dump``), validated the same
    way; ``trigger`` is refused (no optimizer here reports the global norm), and so are the remedies
    (``adaptive_clipping``, ``skip_step``: they act inside DeepSpeed's optimizer step). Call ``measure()`` or
    ``clip_grad_norm_()`` once per optimizer step, after ``backward()`` (and after unscaling, with AMP).
    """

    def __init__(self, model: nn.Module, **options: Any) -> None:
        config = load_config({CONFIG_KEY: {"enabled": True, **options}})
        refused = [
            f"{CONFIG_KEY}.{key}={options[key]!r}: {why}" for key, why in REFUSED.items()
            if key in options and _asks_for(getattr(config, key))
        ]
        if refused:
            raise LayerGradNormsConfigError("; and ".join(refused))
        module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        named = list(module.named_parameters())
        trainable = [(name, param) for name, param in named if param.requires_grad]
        layer_map = build_layer_map(trainable, [name for name, _ in named], config.layer_pattern, config.granularity,
                                    config.group_by)
        self.trainable = [param for _, param in trainable]
        self._steps = 0
        setup = Setup(config, layer_map, layer_map.bucket_of, REPLICATED, completed_steps=lambda: self._steps)
        self.adapter = ParamGradAdapter(self.trainable, setup)

    def measure(self, clip_coef: float = 1.0) -> Optional[dict]:
        """The statistics of the current gradients, or ``None`` off the interval.

        ``clip_coef`` is the factor you are about to multiply the gradients by (post-clip statistics).
        """
        return self._step(lambda measurement: measurement.set_applied_divisor(1.0 / clip_coef))

    def clip_grad_norm_(self, max_norm: float) -> Optional[dict]:
        """Measure, then clip every trainable gradient like ``torch.nn.utils.clip_grad_norm_``."""
        result = self._step(lambda measurement: measurement.set_clip_norm(max_norm))
        torch.nn.utils.clip_grad_norm_(self.trainable, max_norm)
        return result

    def _step(self, set_clipping: Callable[[Measurement], None]) -> Optional[dict]:
        self.adapter.begin_step()
        measured = self.adapter.measurement is not None
        if measured:
            set_clipping(self.adapter.measurement)
        self.adapter.end_step()
        self._steps += 1
        return self.adapter.result() if measured else None
