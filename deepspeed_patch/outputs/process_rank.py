# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""This process's global rank, for the work only one rank does: rank 0 alone writes the files and logs a
decision every rank takes (a switch-off), so that a run of many ranks writes one file and one line."""

import os

from deepspeed import comm as dist


def rank_of_process() -> int:
    """This process's global rank: DeepSpeed's, or under a launcher that did not initialise DeepSpeed's
    communication (torchrun with plain DistributedDataParallel) the ``RANK`` the launcher sets; 0 alone."""
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))
