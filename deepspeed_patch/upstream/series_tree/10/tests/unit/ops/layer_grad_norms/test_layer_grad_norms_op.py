# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team

import pytest
import torch
from deepspeed.ops.op_builder.layer_grad_norms import LayerGradNormsBuilder
from deepspeed.runtime.layer_grad_norms.statistics.kernels import HOST, STOCK, chunk_partition
from deepspeed.runtime.layer_grad_norms.statistics.partition_slices import slices_of_spans
from deepspeed.runtime.layer_grad_norms.statistics.partition_stats import accumulate_partition
from deepspeed.runtime.layer_grad_norms.statistics.partition_stats_cpu import host_kernel
from deepspeed.runtime.layer_grad_norms.statistics.statistics import empty_stats

if not LayerGradNormsBuilder().is_compatible():
    pytest.skip("the layer_grad_norms op is not compatible with this system", allow_module_level=True)

SUMSQ, NONFINITE, L1, SUM, ZEROS, NUMEL, MAX, NEG_MIN, NEG_ABS_MIN = range(9)  # the table's columns
# (start, length, bucket) of each span of a flat partition: spans longer than a chunk, a gap, buckets out of order
SPANS = [(0, 1000, 2), (1000, 70000, 0), (75000, 300, 1), (75300, 140000, 2)]
EXTRA = ("l1", "mean", "zeros")


def reference_table(flat, spans, buckets):
    """Each bucket's statistics of its spans, one span at a time, in float64."""
    table = torch.zeros(buckets, 9, dtype=torch.float64)
    table[:, MAX:] = -float("inf")
    for start, length, bucket in spans:
        span = flat[start:start + length].double()
        row = table[bucket]
        row[SUMSQ] += span.pow(2).sum()
        row[NONFINITE] += (~span.isfinite()).sum()
        row[L1] += span.abs().sum()
        row[SUM] += span.sum()
        row[ZEROS] += (span == 0).sum()
        row[NUMEL] += length
        row[MAX] = max(row[MAX], span.max())
        row[NEG_MIN] = max(row[NEG_MIN], -span.min())
        row[NEG_ABS_MIN] = max(row[NEG_ABS_MIN], -span.abs().min())
    return table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_op_builds_and_matches_torch(dtype):
    """The builder's op is what the host path uses, and its table equals the stock operators' and a float64
    reference: maxima and counts exactly, sums to rounding."""
    assert host_kernel() is not None, "the op did not build or load"
    torch.manual_seed(0)
    flat = torch.randn(SPANS[-1][0] + SPANS[-1][1] + 10).to(dtype)
    flat[5:50] = 0.0
    slices = slices_of_spans(SPANS)
    tables = {}
    for kernel in (HOST, STOCK):
        tables[kernel] = empty_stats(3, "cpu")
        accumulate_partition(tables[kernel], flat, chunk_partition(slices, "cpu", kernel=kernel), EXTRA)
    reference = reference_table(flat, SPANS, 3)
    exact = [NONFINITE, ZEROS, NUMEL, MAX, NEG_MIN, NEG_ABS_MIN]
    for table in tables.values():
        assert torch.equal(table[:, exact], reference[:, exact])
    assert torch.allclose(tables[HOST][:, [SUMSQ, L1, SUM]], reference[:, [SUMSQ, L1, SUM]], rtol=1e-9, atol=1e-9)
    assert torch.allclose(tables[STOCK][:, [SUMSQ, L1, SUM]], reference[:, [SUMSQ, L1, SUM]], rtol=1e-5, atol=1e-4)
