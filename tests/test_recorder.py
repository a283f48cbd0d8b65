"""The flight recorder (``trigger.history``): every recorded step against the plain-PyTorch reference, on 2
and 3 CPU ranks; collectives on quiet and firing steps; the history's lifetime and its dump lines.

One launch per world size runs all of that world's cases (recorder_workers.py).
"""

import json
import math
from functools import lru_cache

import pytest
import torch

from deepspeed_patch.config import LayerGradNormsConfigError, load_config
from deepspeed_patch.on_demand import SpikeTrigger
from deepspeed_patch.reduction import COLLECTIVES_PER_STEP
from megatron_integration.cpu_launch import launch
from recorder_workers import HISTORY, run_recorder
from reference import TOLERANCE, assert_close_stats

WORLDS = (2, pytest.param(3, marks=pytest.mark.extended))  # world 3 in CI's extended pass (tests/README.md)
OPTIMIZERS = {"z1_fp32": "DeepSpeedZeroOptimizer", "z2_fp32_clip_two_fires": "DeepSpeedZeroOptimizer",
              "z0_fp32_clip": "SGD", "bf16_optimizer": "BF16_Optimizer", "z2_fp16_overflow": "DeepSpeedZeroOptimizer"}
STATISTICS_CASES = ("z1_fp32", "z2_fp32_clip_two_fires", "z0_fp32_clip", "bf16_optimizer", "z2_fp16_overflow")


@lru_cache(maxsize=None)
def results_of(world_size: int, workdir: str):
    return launch(run_recorder, world_size, workdir, timeout=600)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("recorder"))


def case_result(workdir: str, world_size: int, name: str):
    """Rank 0's record of the case, and every rank's."""
    by_rank = [ranks[name] for ranks in results_of(world_size, workdir)]
    if "error" in by_rank[0]:
        pytest.fail(by_rank[0]["error"])
    return by_rank[0], by_rank


def first_fire(history):
    """The index of the first step after which a history exists, and that history."""
    index = next(index for index, entry in enumerate(history) if entry is not None)
    return index, history[index]


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("name", STATISTICS_CASES)
def test_every_recorded_step_matches_the_reference(workdir, world_size, name):
    record, _ = case_result(workdir, world_size, name)
    case, on = record["case"], record["on"]
    assert on["optimizer"] == OPTIMIZERS[name]
    fire_step = (case["spikes"] or (case["overflow_step"], ))[0]
    index, history = first_fire(on["history"])
    assert index == fire_step - 1
    assert [entry["step"] for entry in history] == list(range(fire_step - HISTORY + 1, fire_step + 1))
    checked = 0
    for entry in history:
        reference = on["reference"][entry["step"] - 1]
        assert entry["trigger"]["fired_at"] == fire_step
        assert set(entry["pre_clip"]) == set(reference)  # every bucket, not a selection
        if entry["overflow"]:
            assert entry["step"] == case["overflow_step"]
            assert entry["post_clip"] is None and entry["clip_coef"] is None
            nonfinite = [key for key, stats in entry["pre_clip"].items() if stats["nonfinite"] > 0]
            assert nonfinite and all(not math.isfinite(entry["pre_clip"][key]["norm"]) for key in nonfinite)
        else:
            assert_close_stats(entry["pre_clip"], reference, TOLERANCE[case["dtype"]])
            assert all(stats["nonfinite"] == 0 for stats in entry["pre_clip"].values())
            if case["dtype"] == "fp32":  # SGD at lr=1: the weight update is the gradient applied
                assert_close_stats(entry["post_clip"], on["applied"][entry["step"] - 1], 1e-3,
                                   stats=("norm", "min", "max", "abs_max"))
        checked += 1
    assert checked == HISTORY


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("name", STATISTICS_CASES)
def test_history_identical_on_every_rank(workdir, world_size, name):
    _, by_rank = case_result(workdir, world_size, name)
    assert len(by_rank) == world_size > 1
    for other in by_rank[1:]:
        assert repr(other["on"]["history"]) == repr(by_rank[0]["on"]["history"])  # repr: NaNs compare equal


def test_history_is_none_before_a_fire_and_replaced_by_the_next(workdir):
    record, _ = case_result(workdir, 2, "z2_fp32_clip_two_fires")
    history = record["on"]["history"]
    assert history[:6] == [None] * 6
    assert [entry["step"] for entry in history[6]] == [4, 5, 6, 7]
    assert all(later == history[6] for later in history[7:10])
    assert [entry["step"] for entry in history[10]] == [8, 9, 10, 11]
    assert history[10][0]["trigger"]["fired_at"] == 11
    assert history[6][0]["trigger"]["reason"].startswith("grad norm")


def test_the_dump_has_one_line_per_recorded_step(workdir):
    record, _ = case_result(workdir, 2, "z2_fp32_clip_two_fires")
    with open(record["case"]["dump"]) as dump:
        lines = [json.loads(line) for line in dump]
    assert [line["step"] for line in lines if line.get("history")] == [4, 5, 6, 7, 8, 9, 10, 11]
    assert [line["step"] for line in lines if not line.get("history")] == [8, 12]  # the capture windows
    assert lines[0]["pre_clip"]["0"]["norm"] == pytest.approx(record["on"]["history"][6][0]["pre_clip"][0]["norm"])


@pytest.mark.parametrize("world_size", WORLDS)
def test_one_reduction_on_a_fire_and_none_on_quiet_steps(workdir, world_size):
    """Against the same trigger without a ring, and against no block at all: a fire adds the collectives of
    one reduction (the whole ring at once), a quiet step none."""
    record, _ = case_result(workdir, world_size, "z2_fp32_clip_two_fires")
    on, no_history, off = (record[run]["collectives"] for run in ("on", "no_history", "off"))
    fires, captures = {7, 11}, {8, 12}
    assert [a - b for a, b in zip(on, no_history)] == [COLLECTIVES_PER_STEP * (step in fires) for step in range(1, 13)]
    quiet = [step for step in range(1, 13) if step not in fires | captures]
    assert [on[step - 1] for step in quiet] == [off[step - 1] for step in quiet]
    assert len(quiet) == 8


@pytest.mark.parametrize("world_size", WORLDS)
def test_training_is_bit_identical_with_the_recorder_off(workdir, world_size):
    record, _ = case_result(workdir, world_size, "z2_fp32_clip_two_fires")
    assert record["off"]["losses"] == record["on"]["losses"]
    for name, value in record["off"]["final"].items():
        assert torch.equal(value, record["on"]["final"][name]), name


@pytest.mark.parametrize("world_size", WORLDS)
def test_a_reported_loss_spike_fires_the_recorder(workdir, world_size):
    record, _ = case_result(workdir, world_size, "z2_loss_trigger")
    index, history = first_fire(record["on"]["history"])
    assert index == 6 and [entry["step"] for entry in history] == [4, 5, 6, 7]
    assert history[-1]["trigger"]["reason"].startswith("loss")


def test_ring_memory_is_history_times_buckets(workdir):
    record, _ = case_result(workdir, 2, "z1_fp32")
    buckets = len(record["on"]["reference"][0])
    assert record["on"]["ring_bytes"] == HISTORY * (buckets + 1) * 9 * 8


@pytest.mark.parametrize("key,value", [("history", -1), ("history", "four"), ("loss_factor", 1.0)])
def test_bad_recorder_keys_are_named(key, value):
    with pytest.raises(LayerGradNormsConfigError, match=f"layer_grad_norms.trigger.{key}={value!r}"):
        load_config({"layer_grad_norms": {"trigger": {key: value}}})


def test_loss_trigger_waits_for_its_warm_up_and_ignores_unreported_steps():
    trigger = SpikeTrigger(factor=1e9, window=5, capture_steps=2, on_overflow=True, loss_factor=3.0)
    losses = [1.0, None, 1.0, 9.0, 1.0, 1.0, 1.1]  # 9.0 within the warm-up; step 2 reported nothing
    assert [trigger.update(step, 1.0, False, loss) for step, loss in enumerate(losses, 1)] == [None] * 7
    assert trigger.update(8, 1.0, False, 4.0)["reason"] == "loss 4 > 3.0 x median 1"
    assert trigger.update(9, 1.0, False, math.nan)["reason"] == "loss nan"
    assert SpikeTrigger(3.0, 5, 2, True).update(1, 1.0, False, 1e9) is None  # no loss_factor: not watched


def test_megatron_flags_fill_the_trigger_block():
    import argparse

    from megatron_integration.arguments import add_layer_grad_norms_args, layer_grad_norms_block

    parser = add_layer_grad_norms_args(argparse.ArgumentParser())
    args = parser.parse_args(["--log-layer-grad-norms", "--layer-grad-norms-trigger", "4",
                              "--layer-grad-norms-history", "8"])
    block = layer_grad_norms_block(args)
    assert block["trigger"] == {"grad_norm_factor": 4.0, "loss_factor": 4.0, "history": 8}
    assert load_config({"layer_grad_norms": block}).trigger.history == 8
    assert "trigger" not in layer_grad_norms_block(parser.parse_args(["--log-layer-grad-norms"]))
    with pytest.raises(ValueError, match="--layer-grad-norms-history=-1"):
        layer_grad_norms_block(parser.parse_args(["--log-layer-grad-norms", "--layer-grad-norms-history", "-1"]))


def test_megatron_hook_reports_the_loss():
    import argparse

    from megatron_integration.training_log import log_layer_grad_norms

    class Adapter:
        reported = []
        wants_loss = True

        def report_loss(self, loss):
            self.reported.append(loss)

    class Engine:
        layer_grad_norms = Adapter()

        def get_layer_grad_norms(self):
            return None

    args = argparse.Namespace(log_layer_grad_norms=True)
    assert log_layer_grad_norms(Engine(), 3, None, args, loss=2.5) == ""
    assert log_layer_grad_norms(Engine(), 4, None, args) == ""
    Adapter.wants_loss = False  # no trigger.loss_factor: the loss (a device tensor in Megatron) is not read
    assert log_layer_grad_norms(Engine(), 5, None, args, loss=3.5) == ""
    assert Adapter.reported == [2.5]
