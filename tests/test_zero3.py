"""Per-layer statistics from ZeRO stage 3 against a plain-PyTorch reference, on 1, 2 and 3 CPU ranks.

One launch per world size runs all of that world's cases (zero_workers trains them, gathering the
partitioned weights around each step); each test below checks one property of every case it names.
Cases combine properties to keep launches few: padding (32-element parameters on 3 ranks), tied
weights, accumulation, clipping, bf16, fp16 with a skipped step, CPU offload, ``zero.Init``.
The statistics' counts (zeros, numel) are exact where asked for: a padding element would show.
"""

import math
import os
import types
from functools import lru_cache

import pytest
from test_zero_stats import assert_training_unchanged, measured_steps
from zero3_workers import run_all

from megatron_integration.cpu_launch import launch
from reference import TOLERANCE, assert_close_stats

OFFLOAD = {"zero": {"offload_optimizer": {"device": "cpu"}}, "top": {"zero_force_ds_cpu_optimizer": False}}
COUNTS = {"statistics": ["zeros", "numel"]}  # exact counts: any padding element would show
REQUIRE_MICS = "REQUIRE_MICS"  # set by .ci/releases, whose releases (0.14.5, 0.16.9) have MiCS: the refusal must run



def zero3(**case):
    return {"stage": 3, **case}


CASES = {
    1: {"z3_fp32": zero3(steps=2)},
    2: {
        "z3_bf16_clip": zero3(dtype="bf16", clip=0.1, steps=2),
        "z3_fp16_overflow_clip": zero3(dtype="fp16", overflow_step=2, clip=0.1, compare_off=True),
        "z3_zero_init_offload_fp16_overflow_clip": zero3(zero_init=True, dtype="fp16", overflow_step=2, clip=0.1,
                                                         block=COUNTS, **OFFLOAD),
    },
    3: {"z3_fp32_gas2_clip_tied": zero3(gas=2, clip=0.1, tie=True, steps=2, compare_off=True, block=COUNTS)},
}
REFUSED = {2: {"hpZ": {"zero": {"zero_hpz_partition_size": 2}}}}
ALL_CASES = [(world, name) for world, cases in CASES.items() for name in cases]


@lru_cache(maxsize=None)
def results_of(world_size: int):
    return launch(run_all, world_size, CASES[world_size], REFUSED.get(world_size, {}))


def case_result(world_size: int, name: str):
    """Rank 0's record of the case, and every rank's."""
    by_rank = [ranks["cases"][name] for ranks in results_of(world_size)]
    if "error" in by_rank[0]:
        pytest.fail(by_rank[0]["error"])
    return by_rank[0], by_rank


def measured_count(case) -> int:
    """How many steps of ``case`` are measured, from its definition: every step but its overflow (skipped) one."""
    return case["steps"] - (case["overflow_step"] is not None)


def scale_change(record, index: int):
    """(loss scale before the step, after it): ZeRO-3 unscales by the one after (as ZeRO-1/2 does)."""
    return record["on"]["loss_scales"][index]


@pytest.mark.parametrize("world_size,name", ALL_CASES)
def test_pre_clip_matches_reference(world_size, name):
    record, _ = case_result(world_size, name)
    case = record["case"]
    checked = 0
    for _, measured, reference in measured_steps(record):
        assert set(measured["pre_clip"]) == set(reference)
        assert_close_stats(measured["pre_clip"], reference, TOLERANCE[case["dtype"]])
        for key, stats in measured["pre_clip"].items():
            assert stats["nonfinite"] == 0
            for count in case["block"].get("statistics", ()):
                assert stats[count] == reference[key][count], (key, count)
        checked += 1
    assert checked == measured_count(case)


@pytest.mark.parametrize("world_size,name", ALL_CASES)
def test_post_clip_is_what_the_optimizer_applied(world_size, name):
    """SGD at lr=1: the weight update is the gradient the optimizer consumed, clipped, unscaled."""
    record, _ = case_result(world_size, name)
    case = record["case"]
    checked = 0
    for index, measured, _ in measured_steps(record):
        old_scale, new_scale = scale_change(record, index)
        total = math.sqrt(sum(ref["norm"]**2 for ref in record["on"]["layer_reference"][index].values()))
        clip_factor = max(1.0, (total * old_scale / new_scale + 1e-6) / case["clip"]) if case["clip"] else 1.0
        assert measured["clip_coef"] == pytest.approx(old_scale / (new_scale * clip_factor),
                                                      rel=10 * TOLERANCE[case["dtype"]])
        # A low-precision optimizer's fp32 weights show the gradient it consumed, clipped and unscaled: post_clip and
        # with it clip_coef, against what was applied (the model's bf16 weights are too coarse for it).
        master = record["on"]["applied_master"][index]
        assert master is not None or case["dtype"] != "bf16"
        if case["dtype"] != "fp32" and master is not None:
            assert_close_stats(measured["post_clip"], master, 1e-3, stats=("norm", "min", "max", "abs_max"))
        applied = record["on"]["applied"][index]
        if case["dtype"] == "fp32":
            assert_close_stats(measured["post_clip"], applied, 1e-3, stats=("norm", "min", "max", "abs_max"))
        if case["dtype"] == "fp16":  # the small weights of the layers show the update to a few percent
            layers = {key: stats for key, stats in applied.items() if isinstance(key, int)}
            assert_close_stats(measured["post_clip"], layers, 3e-2, stats=("norm", ))
        checked += 1
    assert checked == measured_count(case)


@pytest.mark.parametrize("world_size,name", ALL_CASES)
def test_bucket_norms_add_up_to_global_norm(world_size, name):
    """ZeRO-3's get_global_grad_norm() divides by the loss scale as updated for the next step."""
    record, _ = case_result(world_size, name)
    checked = 0
    for index, measured, _ in measured_steps(record):
        old_scale, new_scale = scale_change(record, index)
        combined = math.sqrt(sum(stats["norm"]**2 for stats in measured["pre_clip"].values()))
        assert combined * old_scale / new_scale == pytest.approx(float(record["on"]["global_norm"][index]), rel=1e-5)
        checked += 1
    assert checked == measured_count(record["case"])


@pytest.mark.parametrize("world_size,name", ALL_CASES)
def test_identical_on_every_rank_and_stage3(world_size, name):
    _, by_rank = case_result(world_size, name)
    assert by_rank[0]["on"]["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    for other in by_rank[1:]:
        assert repr(other["on"]["measured"]) == repr(by_rank[0]["on"]["measured"])


@pytest.mark.parametrize("world_size,name", [(w, n) for w, n in ALL_CASES if CASES[w][n].get("compare_off")])
def test_training_is_bit_identical_with_the_feature_off(world_size, name):
    assert_training_unchanged(case_result(world_size, name)[0])


@pytest.mark.parametrize("world_size,name", [(w, n) for w, n in ALL_CASES if CASES[w][n].get("overflow_step")])
def test_overflow_step_reports_nonfinite_layers(world_size, name):
    record, _ = case_result(world_size, name)
    step = record["case"]["overflow_step"]
    measured = record["on"]["measured"][step - 1]
    assert (measured["step"], measured["overflow"], measured["post_clip"]) == (step, True, None)
    counts = [stats["nonfinite"] for stats in measured["pre_clip"].values()]
    assert sum(counts) > 0


def test_tied_weight_counted_once():
    record, _ = case_result(3, "z3_fp32_gas2_clip_tied")
    assert "head" not in record["on"]["measured"][-1]["pre_clip"]


def test_hpz_refused_at_initialize():
    refused = results_of(2)[0]["refused"]["hpZ"]
    assert "UnsupportedSetupError" in refused and "zero_hpz_partition_size=2" in refused, refused


def test_unsupported_set_ups_are_named():
    """NVMe offload, partial offload and MiCS are named (checked on the optimizer's bookkeeping alone)."""
    from deepspeed_patch import capabilities
    from deepspeed_patch.adapters.zero3 import Zero3Adapter

    release = capabilities.installed()

    group = object()
    plain = dict(fp16_groups=[], dp_process_group=group, zero_hpz_partition_size=1, swap_optimizer=False,
                 params_in_nvme_and_cpu=False, offload_optimizer=True, partial_offload=1.0)
    assert Zero3Adapter.unsupported(types.SimpleNamespace(**plain), {}, release) == []
    nvme = types.SimpleNamespace(**{**plain, "swap_optimizer": True, "params_in_nvme_and_cpu": True,
                                    "partial_offload": 0.5})
    assert Zero3Adapter.unsupported(nvme, {}, release) == [
        "NVMe offload of the optimizer (offload_optimizer.device=nvme)",
        "NVMe offload of the parameters (offload_param.device=nvme)",
        "partial optimizer offload (offload_optimizer.ratio=0.5)"]
    if not release.zero3_mics:  # .ci/releases runs this on releases that have MiCS, where a skip must fail
        (pytest.fail if os.environ.get(REQUIRE_MICS) else pytest.skip)(f"DeepSpeed {release.release} has no MiCS")
    from deepspeed.runtime.zero.mics import MiCS_Optimizer

    mics = object.__new__(MiCS_Optimizer)
    mics.__dict__.update(plain)
    assert Zero3Adapter.unsupported(mics, {}, release) == ["MiCS (its own shard groups)"]
