"""ZeRO-1/2 with DeepSpeed's ``zero_optimization.compute_grad_norm: false``: the optimizer computes no
global norm (``unscale_and_clip_grads`` gets ``None``; clipping must be off), yet the statistics and their
clip factor stay right, against the plain-PyTorch reference (tests/reference.py), on 2 CPU ranks."""

from functools import lru_cache

import pytest

from deepspeed_patch.capabilities import installed
from megatron_integration.cpu_launch import launch
from reference import TOLERANCE, assert_close_stats
from zero_workers import run_cases

if not installed().zero_compute_grad_norm_option:
    pytest.skip(f"DeepSpeed {installed().release} has no zero_optimization.compute_grad_norm",
                allow_module_level=True)

pytestmark = pytest.mark.extended  # a 2-rank launch of its own for one option: CI's extended pass (tests/README.md)

NO_NORM = {"compute_grad_norm": False}
CASES = {
    "z1_fp32": {"stage": 1, "zero": NO_NORM},
    "z2_bf16_gas2": {"stage": 2, "dtype": "bf16", "gas": 2, "zero": NO_NORM},
    "z1_fp16": {"stage": 1, "dtype": "fp16", "zero": NO_NORM},
    "z2_fp16_overflow": {"stage": 2, "dtype": "fp16", "overflow_step": 2, "zero": NO_NORM},
}


@lru_cache(maxsize=None)
def records():
    return launch(run_cases, 2, CASES)


def record_of(name: str):
    record = records()[0][name]
    if "error" in record:
        pytest.fail(record["error"])
    return record


@pytest.mark.parametrize("name", list(CASES))
def test_no_global_norm_yet_statistics_match_reference(name):
    record = record_of(name)
    on = record["on"]
    assert all(norm is None for norm in on["global_norm"])  # DeepSpeed computed none
    checked = 0
    for index, (measured, reference) in enumerate(zip(on["measured"], on["reference"])):
        assert measured["step"] == index + 1
        if measured["overflow"]:
            assert index + 1 == record["case"]["overflow_step"]
            assert measured["post_clip"] is None
            assert sum(stats["nonfinite"] for stats in measured["pre_clip"].values()) > 0
            continue
        assert_close_stats(measured["pre_clip"], reference, TOLERANCE[record["case"]["dtype"]])
        # No clipping: the factor is what the loss-scale update makes of the gradient (old / new scale).
        old_scale, new_scale = on["loss_scales"][index]
        assert measured["clip_coef"] == pytest.approx(old_scale / new_scale, rel=1e-12)
        # SGD at lr=1: the update is the post-clip gradient; in fp16, the update of the optimizer's fp32 weights
        applied = on["applied"][index] if record["case"]["dtype"] == "fp32" else on["applied_master"][index]
        assert_close_stats(measured["post_clip"], applied, 1e-3, stats=("norm", "min", "max"))
        checked += 1
    assert checked == record["case"]["steps"] - (record["case"]["overflow_step"] is not None)


def test_identical_on_every_rank():
    for name in CASES:
        assert repr(records()[1][name]["on"]["measured"]) == repr(records()[0][name]["on"]["measured"])


def test_fp16_case_covers_a_loss_scale_growth_step():
    """The old/new scale factor of clip_coef is exercised, not only written down."""
    scales = record_of("z1_fp16")["on"]["loss_scales"]
    assert any(new > old for old, new in scales)
