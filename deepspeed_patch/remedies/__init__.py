# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The opt-in remedies, decided from the step's reduced table before the optimizer steps (``remedies``):
AdaGC's per-bucket clipping (``adaptive_clipping``) and skipping an outlier step (``skip_step``), carried out in
each optimizer step by ``remedy_step``.
"""
