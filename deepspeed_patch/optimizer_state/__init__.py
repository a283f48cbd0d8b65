# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What the optimizer step did, per bucket: the fp32 weights, the update and Adam's moments (``optimizer_stats``),
the update derived from the state by Adam's rule (``adam_rule``).
"""
