# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The per-layer gradient statistics of one step: which parameters make a bucket (``layer_map``), which spans of
a flat partition are whose (``partition_slices``), the table and its columns (``statistics``), how a partition is
folded into it (``partition_stats``), its reduction over ranks (``reduction``), one step's measurement
(``measurement``) and its result (``result``), the clipping divisor (``clipping``) and which steps are measured
(``steps``).
"""
