# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Where the results go (``publish``): the last result, DeepSpeed's monitors (``monitor``) and the files written
beside them; ``process_rank`` says which rank writes.
"""
