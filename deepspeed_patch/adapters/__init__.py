# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""One adapter per optimizer family, between DeepSpeed and the per-layer statistics: the attributes it reads, where
it reads the gradient and what the optimizer divides it by. ``base`` holds the step protocol; ``attach`` picks one.
"""

from typing import Optional

from ..config import CONFIG_KEY, UnsupportedSetupError
from ..spikes.trigger import FireSelector, History
from .attach import attach
from .base import LayerGradNormsAdapter

__all__ = [
    "attach", "get_layer_grad_norms", "get_layer_grad_norms_history", "set_layer_grad_norms", "LayerGradNormsAdapter"
]


def get_layer_grad_norms(owner) -> Optional[dict]:
    """Per-layer gradient statistics of the last measured optimizer step, or ``None``.

    ``{"step", "overflow", "clip_coef", "pre_clip": {bucket: {"norm", "min", "max", "abs_min",
    "abs_max", "nonfinite", ...}}, "post_clip": {...}}``, the same on every rank; buckets are
    transformer layers (``int``) and the parameters outside them (``str``).
    """
    adapter = owner.layer_grad_norms
    return None if adapter is None else adapter.result()


def get_layer_grad_norms_history(owner, fire: FireSelector = None) -> History:
    """The flight recorder's steps at the trigger's fires (``trigger.history``), oldest first; ``None`` before
    any fire (or without a recorder).

    ``fire=None``: the last fire's; ``fire=N``: the fire's at step N (``None`` if none fired there); ``"all"``:
    ``{fired_at: steps}`` of the last ``trigger.KEPT_FIRES`` fires, oldest first. Each entry is shaped like
    ``get_layer_grad_norms()``, with every bucket and the trigger's record under ``"trigger"``; the same on
    every rank. Each recorded step belongs to one fire only: a fire within ``history`` steps of the one before
    holds only the steps after that one's.
    """
    adapter = owner.layer_grad_norms
    return None if adapter is None else adapter.history(fire)


def set_layer_grad_norms(engine,
                         enabled: Optional[bool] = None,
                         interval: Optional[int] = None,
                         layers: Optional[object] = None) -> None:
    """Switch per-layer statistics on or off, or change their interval or layers, on a live engine.

    Call it on every rank at the same step (as SPMD training code does); the ds_config needs a
    ``layer_grad_norms`` block at initialize (``enabled: false`` with a trigger or control file, or
    ``enabled: true``).
    """
    if engine.layer_grad_norms is None:
        raise UnsupportedSetupError(f"set_layer_grad_norms: this engine was initialized without an enabled "
                                    f"'{CONFIG_KEY}' block, so there is no layer map to measure with")
    engine.layer_grad_norms.set_options(enabled=enabled, interval=interval, layers=layers)
