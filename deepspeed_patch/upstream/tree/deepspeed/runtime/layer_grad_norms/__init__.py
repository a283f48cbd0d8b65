# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Per-layer gradient statistics (L2 norm, min, max, before and after clipping) inside the ZeRO-1/2,
BF16 and FP16 optimizers; enabled by the ``layer_grad_norms`` block of the ds_config and read with
``engine.get_layer_grad_norms()``. ``call_sites`` holds what the engine and the optimizers call."""

from .config import LayerGradNormsConfig, LayerGradNormsConfigError
from .plain import LayerGradNorms

__all__ = ["LayerGradNorms", "LayerGradNormsConfig", "LayerGradNormsConfigError"]
