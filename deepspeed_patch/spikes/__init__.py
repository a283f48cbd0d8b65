# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Catching a spike: the trigger's rule and state, the flight recorder of the steps before it, the control file."""
