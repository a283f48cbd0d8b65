# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team

from .builder import OpBuilder


class LayerGradNormsBuilder(OpBuilder):
    """The host kernels of per-layer gradient statistics (``deepspeed/runtime/layer_grad_norms``): a flat
    gradient partition's statistics per bucket, and an fp32 master partition's with its Adam moments, each in one
    read. They work on host tensors under every accelerator; where the op cannot be built, the statistics use
    stock PyTorch operators (same results, slower)."""
    BUILD_VAR = "DS_BUILD_LAYER_GRAD_NORMS"
    NAME = "layer_grad_norms"

    def __init__(self):
        super().__init__(name=self.NAME)

    def absolute_name(self):
        return f'deepspeed.ops.{self.NAME}.{self.NAME}_op'

    def sources(self):
        return ['csrc/layer_grad_norms/partition_stats.cpp']

    def cxx_args(self):
        # no -march=native: the library carries AVX-512, AVX2 and baseline loops and picks one when it loads
        return ['-O3', '-fopenmp', '-fno-math-errno']

    def extra_ldflags(self):
        return ['-fopenmp']
