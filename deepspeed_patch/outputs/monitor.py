# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Per-layer statistics to DeepSpeed's own monitors (TensorBoard, W&B, CSV), as the engine writes its
other training scalars: one event per selected bucket, phase and statistic, against the samples seen,
named as every other writer names them (``tags``), under DeepSpeed's ``Train/Samples/`` prefix:
``Train/Samples/layer-grad-norms/pre-clip/layer00``."""

import weakref
from typing import Optional

from .publish import Reader
from .tags import flat_scalars


class MonitorEvents(Reader):
    """Writes each measured step's result to the engine's monitors (through ``publish.Consumer``)."""

    def __init__(self, engine) -> None:
        self.engine = weakref.ref(engine)  # the engine holds the adapter that holds this

    @staticmethod
    def wanted(engine, enabled_by_config: bool) -> Optional["MonitorEvents"]:
        """A writer for ``engine`` if the block's ``monitor`` key and the ds_config's monitors ask for one."""
        if enabled_by_config and getattr(engine.monitor, "enabled", False):
            return MonitorEvents(engine)
        return None

    def write(self, result: dict) -> None:
        engine = self.engine()
        engine.monitor.write_events([(f"Train/Samples/{tag}", value, engine.global_samples)
                                     for tag, value in flat_scalars(result).items()])
