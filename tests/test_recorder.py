"""The flight recorder (``trigger.history``): every recorded step against the plain-PyTorch reference, on 2
and 3 CPU ranks; collectives on quiet and firing steps; the history's lifetime and its dump lines.

One launch per world size runs all of that world's cases (recorder_workers.py).
"""

import json
import math
import os
import subprocess
from functools import lru_cache

import pytest
import torch

from deepspeed_patch.config import LayerGradNormsConfigError, load_config
from deepspeed_patch.spikes.recorder import BEFORE_BLOCKS
from deepspeed_patch.spikes.spike_rule import SpikeTrigger
from deepspeed_patch.statistics.reduction import COLLECTIVES_PER_STEP
from megatron_integration.cpu_launch import launch
from recorder_workers import FAULTY_STEP, FULL_DISK, HISTORY, OVERFLOW_IN_BLOCK, run_recorder
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
    """The launches' folder, with a full disk for the dump in ``FULL_DISK``: a tmpfs of 16 KiB, as root."""
    path = tmp_path_factory.mktemp("recorder")
    full = path / FULL_DISK
    full.mkdir()
    if os.geteuid() == 0:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(full)], check=False)
    yield str(path)
    if os.path.ismount(full):
        subprocess.run(["umount", str(full)], check=True)


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


def steps_of(entries):
    return [entry["step"] for entry in entries]


def test_history_is_none_before_a_fire_then_the_last_fires_and_every_fire_stays_readable(workdir):
    record, _ = case_result(workdir, 2, "z2_fp32_clip_two_fires")
    history = record["on"]["history"]
    assert history[:6] == [None] * 6
    assert steps_of(history[6]) == [4, 5, 6, 7]
    assert all(later == history[6] for later in history[7:10])
    assert steps_of(history[10]) == [8, 9, 10, 11]
    assert history[10][0]["trigger"]["fired_at"] == 11
    assert history[6][0]["trigger"]["reason"].startswith("grad norm")
    assert {fire: steps_of(entries) for fire, entries in record["on"]["fires"].items()} == {7: [4, 5, 6, 7],
                                                                                          11: [8, 9, 10, 11]}
    assert record["on"]["fires"][7] == history[6]


def test_the_dump_has_one_line_per_recorded_step(workdir):
    record, _ = case_result(workdir, 2, "z2_fp32_clip_two_fires")
    with open(record["case"]["dump"]) as dump:
        lines = [json.loads(line) for line in dump]
    assert [line["step"] for line in lines if line.get("history")] == [4, 5, 6, 7, 8, 9, 10, 11]
    assert [line["step"] for line in lines if not line.get("history")] == [8, 12]  # the captured steps
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


def test_ring_memory_is_history_and_blocks_times_buckets(workdir):
    record, _ = case_result(workdir, 2, "z1_fp32")
    buckets = len(record["on"]["reference"][0])
    assert record["on"]["ring_bytes"] == (HISTORY + BEFORE_BLOCKS) * (buckets + 1) * 9 * 8


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("name", STATISTICS_CASES)
def test_the_level_before_the_recorded_steps_matches_the_reference(workdir, world_size, name):
    """Each fire's first recorded step carries the steps that left the ring, in blocks of ``HISTORY`` steps: per
    bucket, the root mean square of the plain-PyTorch reference's pre-clip norms over the block's steps (the fp16
    case's gradients unscaled step by step)."""
    record, _ = case_result(workdir, world_size, name)
    on = record["on"]
    checked = 0
    for fired_at, entries in on["fires"].items():
        blocks = entries[0]["before"]
        left = list(range(1, fired_at - HISTORY + 1))  # every step before the ring
        expected = [left[start:start + HISTORY] for start in range(0, len(left), HISTORY)]
        assert [block["steps"] for block in blocks] == [[steps[0], steps[-1]] for steps in expected]
        for block, steps in zip(blocks, expected):
            reference = {key: {"norm": math.sqrt(sum(on["reference"][step - 1][key]["norm"]**2 for step in steps)
                                                 / len(steps))} for key in on["reference"][0]}
            assert_close_stats(block["pre_clip"], reference, TOLERANCE[record["case"]["dtype"]], stats=("norm", ))
            assert all(stats["nonfinite"] == 0 for stats in block["pre_clip"].values())
            checked += 1
    assert checked == {"z2_fp32_clip_two_fires": 3}.get(name, 1)


@pytest.mark.parametrize("world_size", WORLDS)
def test_an_overflowed_step_stays_out_of_its_block(workdir, world_size):
    """An fp16 step the loss scaler skipped (step 2) folds no ``inf`` into the recorder's block: the block's norm
    is the root mean square of the reference's norms over its finite steps only, and counts no non-finite value."""
    record, _ = case_result(workdir, world_size, "z2_fp16_overflow_in_block")
    overflowed, fired_at = OVERFLOW_IN_BLOCK
    on = record["on"]
    assert list(on["fires"]) == [fired_at]
    blocks = on["fires"][fired_at][0]["before"]
    assert [block["steps"] for block in blocks] == [[1, HISTORY], [HISTORY + 1, fired_at - HISTORY]]
    steps = [step for step in range(1, HISTORY + 1) if step != overflowed]
    reference = {key: {"norm": math.sqrt(sum(on["reference"][step - 1][key]["norm"]**2 for step in steps)
                                         / len(steps))} for key in on["reference"][0]}
    assert_close_stats(blocks[0]["pre_clip"], reference, TOLERANCE["fp16"], stats=("norm", ))
    assert all(stats["nonfinite"] == 0 for stats in blocks[0]["pre_clip"].values())
    assert len(blocks[0]["pre_clip"]) == len(reference)


@pytest.mark.parametrize("key,value", [("history", -1), ("history", "four"), ("loss_factor", 1.0)])
def test_bad_recorder_keys_are_named(key, value):
    with pytest.raises(LayerGradNormsConfigError, match=f"layer_grad_norms.trigger.{key}={value!r}"):
        load_config({"layer_grad_norms": {"trigger": {key: value}}})


def test_loss_trigger_waits_for_its_warm_up_and_ignores_unreported_steps():
    trigger = SpikeTrigger(norm_ratio=1e9, window=5, capture_steps=2, on_overflow=True, loss_ratio=3.0)
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
    with pytest.raises(SystemExit):  # refused by the parser, naming the flag (test_megatron_integration.py)
        parser.parse_args(["--log-layer-grad-norms", "--layer-grad-norms-history", "-1"])


def test_megatron_hook_reports_the_loss():
    import argparse

    from megatron_integration.training_log import log_layer_grad_norms

    class Adapter:
        reported = []
        wants_loss = True

        def report_loss(self, loss, before_step=True):
            assert not before_step  # the hook runs after the step: the loss is not skip_step's
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


def assert_ranks_agree(by_rank, steps: int):
    """Every rank trained every step, and has the same results, histories and fires."""
    assert len(by_rank) >= 2
    for rank in by_rank:
        assert len(rank["on"]["losses"]) == steps
    for other in by_rank[1:]:
        for what in ("measured", "history", "fires"):
            assert repr(other["on"][what]) == repr(by_rank[0]["on"][what]), what


def tracebacks(rank_record):
    return [message for message, traceback in rank_record["on"]["logs"] if traceback]


def test_overlapping_fires_publish_each_recorded_step_once(workdir):
    record, by_rank = case_result(workdir, 2, "z2_overlapping_fires")
    assert_ranks_agree(by_rank, 10)
    on = record["on"]
    assert {fire: steps_of(entries) for fire, entries in on["fires"].items()} == {7: [4, 5, 6, 7], 9: [8, 9]}
    assert steps_of(on["history"][6]) == [4, 5, 6, 7] and steps_of(on["history"][8]) == [8, 9]
    checked = 0
    for fire, entries in on["fires"].items():
        for entry in entries:
            assert entry["trigger"]["fired_at"] == fire
            assert_close_stats(entry["pre_clip"], on["reference"][entry["step"] - 1], TOLERANCE["fp32"])
            checked += 1
    assert checked == 6
    with open(record["case"]["dump"]) as dump:
        lines = [json.loads(line) for line in dump]
    assert [line["step"] for line in lines if line.get("history")] == [4, 5, 6, 7, 8, 9]


def test_a_fire_before_the_ring_is_full_holds_the_steps_so_far(workdir):
    record, by_rank = case_result(workdir, 2, "z2_fire_before_the_ring_is_full")
    assert_ranks_agree(by_rank, 8)
    history = record["on"]["history"][6]
    assert steps_of(history) == [1, 2, 3, 4, 5, 6, 7]
    for entry in history:
        assert_close_stats(entry["pre_clip"], record["on"]["reference"][entry["step"] - 1], TOLERANCE["fp32"])


def test_a_fire_drops_and_names_the_recorded_steps_the_ranks_disagree_on(workdir):
    """Rank 1 misses recording step 5: its ring slots shift, and only step 4 stays aligned."""
    record, by_rank = case_result(workdir, 2, "z2_shifted_ring")
    assert_ranks_agree(by_rank, 8)
    assert steps_of(record["on"]["history"][6]) == [4]
    assert_close_stats(record["on"]["history"][6][0]["pre_clip"], record["on"]["reference"][3], TOLERANCE["fp32"])
    for rank in by_rank:
        named = [message for message, _ in rank["on"]["logs"] if "ranks disagree" in message]
        assert len(named) == 1 and named[0].endswith(": 3 to 7, 5 to 6, 6 to 7"), named


def test_a_full_disk_under_rank_0s_dump_stops_the_dump_alone_logged_once(workdir):
    if not os.path.ismount(os.path.join(workdir, FULL_DISK)):
        pytest.skip("needs root, to mount a small tmpfs")
    record, by_rank = case_result(workdir, 2, "fault_dump_on_a_full_disk")
    assert_ranks_agree(by_rank, 8)
    on = record["on"]
    assert steps_of(on["measured"]) == list(range(1, 9))  # the statistics go on
    assert steps_of(on["fires"][7]) == [4, 5, 6, 7]  # and the trigger and the recorder
    failures = tracebacks(record)
    assert len(failures) == 1 and "the JSONL dump failed" in failures[0] and "on rank 0" in failures[0]
    assert all(tracebacks(rank) == [] for rank in by_rank[1:])
    with open(record["case"]["dump"]) as dump:
        written = len(dump.readlines())
    assert 0 < written < 8


def test_a_monitor_raising_on_rank_0_stops_itself_alone_logged_once(workdir):
    record, by_rank = case_result(workdir, 2, "fault_monitor_on_rank_0")
    assert_ranks_agree(by_rank, 8)
    assert steps_of(record["on"]["measured"]) == list(range(1, 9))
    assert steps_of(record["on"]["fires"][7]) == [4, 5, 6, 7]
    failures = tracebacks(record)
    assert len(failures) == 1 and "DeepSpeed's monitors failed at step 1" in failures[0]
    assert all(tracebacks(rank) == [] for rank in by_rank[1:])


def test_a_failure_on_a_record_only_step_switches_off_every_rank_at_the_fire_logged_once(workdir):
    """Rank 1 fails to read step 5, only recorded: the fire at 7 publishes step 4 (every rank measured it),
    leaves out 5 to 7, and every rank switches off there; no capture follows."""
    record, by_rank = case_result(workdir, 2, "fault_record_only_step_on_rank_1")
    assert_ranks_agree(by_rank, 8)
    on = record["on"]
    assert {fire: steps_of(entries) for fire, entries in on["fires"].items()} == {7: [4]}
    assert on["measured"] == [None] * 8
    failures = tracebacks(by_rank[1])
    assert len(failures) == 1 and f"failed at step {FAULTY_STEP}" in failures[0]
    assert tracebacks(by_rank[0]) == []
    for rank in by_rank:
        messages = [message for message, _ in rank["on"]["logs"]]
        assert sum("could not measure step 7" in message for message in messages) == 1
        assert sum("a rank could not measure: [5, 6, 7]" in message for message in messages) == 1


def test_fires_are_kept_by_step_each_recorded_step_once_and_the_oldest_dropped_past_the_bound():
    from deepspeed_patch.spikes.trigger import KEPT_FIRES, TriggerState

    state = TriggerState(None)
    fires = list(range(10, 10 + 3 * (KEPT_FIRES + 2), 3))  # every 3 steps, a ring of 5: each overlaps the last
    for fire in fires:
        entries = state.keep({"fired_at": fire}, [{"step": step} for step in range(fire - 4, fire + 1)])
        assert steps_of(entries) == (list(range(6, 11)) if fire == 10 else [fire - 2, fire - 1, fire])
        assert all(entry["trigger"]["fired_at"] == fire for entry in entries)
    kept = state.history("all")
    assert list(kept) == fires[-KEPT_FIRES:]
    assert state.history() == kept[fires[-1]] and state.history(fires[-2]) == kept[fires[-2]]
    assert state.history(fires[0]) is None and state.history(11) is None


def test_the_spike_watch_alone_records_each_step_and_replays_the_ring_at_a_fire():
    """``SpikeWatch`` on one process, without an adapter: the steps it recorded come back at a fire with the norms of
    the gradients observed (a plain-PyTorch norm of each bucket's tensors), a step ``skip_step`` skipped is a fire
    of its own, and a failing push goes to the latch, not to training."""
    from types import SimpleNamespace

    from deepspeed_patch.config import TriggerConfig
    from deepspeed_patch.spikes.trigger import SpikeWatch
    from deepspeed_patch.statistics.measurement import Measurement
    from deepspeed_patch.statistics.reduction import REPLICATED
    from deepspeed_patch.statistics.steps import FailureLatch

    layer_map = SimpleNamespace(num_rows=2, keys=[0, 1])
    latch = FailureLatch()
    watch = SpikeWatch(TriggerConfig(grad_norm_factor=3.0, window=3, capture_steps=1, history=3), layer_map, "cpu",
                       None, latch)
    generator = torch.Generator().manual_seed(0)
    observed, fired = {}, []
    for step in range(1, 8):
        gradients = [torch.randn(5, generator=generator, dtype=torch.float64) * (50.0 if step == 7 else 1.0)
                     for _ in range(2)]
        observed[step] = [gradient.norm().item() for gradient in gradients]
        measurement = Measurement(step, layer_map.num_rows, 1, "cpu", ())
        measurement.observe(0, gradients, torch.tensor([0, 1]))
        watch.record(measurement, overflow=False)
        fired.append(watch.trigger.after_step(step, math.hypot(*observed[step]), False))
    assert fired[:-1] == [None] * 6 and fired[-1]["fired_at"] == 7
    entries = watch.replay(fired[-1], REPLICATED, ())
    assert [entry["step"] for entry in entries] == [5, 6, 7]
    checked = 0
    for entry in entries:
        for bucket in (0, 1):
            assert entry["pre_clip"][bucket]["norm"] == pytest.approx(observed[entry["step"]][bucket], rel=1e-12)
            checked += 1
    assert checked == 6 and watch.trigger.history() == entries
    assert watch.skip_fire(8, "loss") == {"fired_at": 8, "reason": "skip_step: loss", "capture_until": 9}

    def full_ring(table, scales):
        raise RuntimeError("injected push failure")

    watch.recorder.push = full_ring
    watch.record(Measurement(8, layer_map.num_rows, 1, "cpu", ()), overflow=False)
    assert latch.failed_locally and not latch.broken
