# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The adapter of a DeepSpeed optimizer (``OptimizerAdapter``): the step protocol of ``base``, with the loss
scaler's overflow and the global norm read from the optimizer itself, and the optimizer's features the family
cannot measure named for the refusal at initialize.
"""

from typing import Dict, List, Optional

import torch

from ..capabilities import Capabilities
from .base import LayerGradNormsAdapter, Setup


class OptimizerAdapter(LayerGradNormsAdapter):
    """An adapter of a DeepSpeed optimizer that reports its own loss-scaler overflow and global norm."""

    def __init__(self, optimizer, setup: Setup, num_groups: int, device) -> None:
        self.optimizer = optimizer
        self.capabilities = setup.capabilities
        super().__init__(setup, num_groups, device)

    @staticmethod
    def unsupported(optimizer, names: Dict[torch.nn.Parameter, str], capabilities: Capabilities) -> List[str]:
        """The features of this ``optimizer`` the family cannot measure, named for the refusal at initialize
        (``names``: the engine's parameter names)."""
        return []

    def overflow(self) -> bool:
        return bool(self.optimizer.overflow)

    def global_norm(self) -> Optional[float]:
        return self.optimizer._global_grad_norm
