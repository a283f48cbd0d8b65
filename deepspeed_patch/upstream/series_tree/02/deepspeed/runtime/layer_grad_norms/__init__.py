# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Per-layer gradient statistics (L2 norm, min, max, before and after clipping) read inside DeepSpeed's
optimizers; enabled by the ``layer_grad_norms`` block of the ds_config and read with
``engine.get_layer_grad_norms()``. What the config, the engine and the optimizers call is exported
here; ``adapters`` holds one adapter per optimizer family."""

from .adapters import attach, get_layer_grad_norms, get_layer_grad_norms_history, set_layer_grad_norms
from .config import LayerGradNormsConfig, LayerGradNormsConfigError, load_config

__all__ = [
    "attach", "get_layer_grad_norms", "get_layer_grad_norms_history", "set_layer_grad_norms", "load_config",
    "LayerGradNormsConfig", "LayerGradNormsConfigError"
]
