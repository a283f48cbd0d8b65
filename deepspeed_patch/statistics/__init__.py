# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The per-layer gradient statistics of one step, from the spans of a partition to the reduced table and its result."""
