"""On demand: the spike trigger and its policy, switching on and off on a live run, the JSONL dump, DeepSpeed's
monitors; NaN through a real 2-rank reduction."""

import glob
import json
import math
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List

import pytest
import torch

from deepspeed_patch.config import LayerGradNormsConfigError, load_config
from deepspeed_patch.outputs.jsonl_dump import JsonlDump
from deepspeed_patch.spikes.spike_rule import SpikeTrigger
from megatron_integration.cpu_launch import launch
from on_demand_workers import AGREED_LOSSES, NAN_CASES, OWN_LOSS_SPIKE, run_on_demand


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("on_demand"))
    return workdir, launch(run_on_demand, 2, workdir, timeout=420)


@pytest.fixture(scope="module")
def extended_runs(tmp_path_factory):
    """The extended tier's launch: four more engines (each rank's own loss, the fp16 scale's growth)."""
    workdir = str(tmp_path_factory.mktemp("on_demand_extended"))
    return workdir, launch(run_on_demand, 2, workdir, True, timeout=420)


def measured_steps(records):
    return sorted({record["step"] for record in records if record is not None})


def test_trigger_captures_after_a_spike_and_an_overflow_only(runs):
    _, (first, second) = runs
    assert repr(first["trigger"]) == repr(second["trigger"])
    records = first["trigger"]
    assert measured_steps(records) == [9, 10, 14, 15]  # 2 steps after the spike (8) and the overflow (13)
    spike, overflow = records[8], records[13]
    assert spike["trigger"]["fired_at"] == 8 and spike["trigger"]["reason"].startswith("grad norm")
    assert overflow["trigger"] == {"fired_at": 13, "reason": "overflow", "capture_until": 15}
    assert sorted(k for k in spike["pre_clip"] if isinstance(k, int)) == [0, 1, 2, 3]  # all layers, not "0"


def test_dump_has_one_line_per_measured_step(runs):
    workdir, (first, _) = runs
    with open(os.path.join(workdir, "layer_grad_norms.jsonl")) as dump:
        lines = [json.loads(line) for line in dump]
    assert [line["step"] for line in lines] == [9, 10, 14, 15]
    assert lines[0]["pre_clip"]["0"]["norm"] == pytest.approx(first["trigger"][8]["pre_clip"][0]["norm"])


def test_switching_on_and_off_through_the_engine_method(runs):
    _, (first, second) = runs
    assert repr(first["method"]) == repr(second["method"])
    assert measured_steps(first["method"]) == [3, 4]
    assert sorted(k for k in first["method"][3]["pre_clip"] if isinstance(k, int)) == [0]


def test_switching_on_and_off_through_the_control_file(runs):
    _, (first, second) = runs
    assert repr(first["control"]) == repr(second["control"])
    # written before steps 4 (on) and 6 (off); read by rank 0 at the polls of steps 4 and 6, applied by every
    # rank at the next poll (steps 6 and 8), when the flag's all-reduce issued at the read is complete
    assert measured_steps(first["control"]) == [6, 7]


def test_monitor_events_in_csv_and_tensorboard(runs):
    workdir, (first, _) = runs
    csv_name = "Train_Samples_layer-grad-norms_pre-clip_layer00.csv"  # the csv monitor turns "/" into "_"
    csv_files = glob.glob(os.path.join(workdir, "monitors", "csv", csv_name))
    assert len(csv_files) == 1
    with open(csv_files[0]) as values:
        rows = values.read().splitlines()
    assert len(rows) == 3  # header, 2 steps
    assert float(rows[-1].split(",")[1]) == pytest.approx(first["monitor"][-1]["pre_clip"][0]["norm"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(workdir, "monitors", "tb"))
    events.Reload()
    assert "Train/Samples/layer-grad-norms/values/max/post-clip/layer03" in events.Tags()["scalars"]


def test_trigger_ignores_ordinary_steps():
    trigger = SpikeTrigger(norm_ratio=3.0, window=5, capture_steps=4, on_overflow=True)
    assert all(trigger.update(step, 1.0 + 0.1 * (step % 3), False) is None for step in range(1, 20))
    assert trigger.update(20, 3.1, False) is None  # 3.1 < 3 x median 1.1
    assert trigger.update(21, 9.0, False)["capture_until"] == 25
    assert SpikeTrigger(3.0, 5, 4, on_overflow=False).update(1, None, True) is None


def test_trigger_after_a_resume_fires_on_overflow_at_once_and_on_a_spike_after_its_warm_up():
    """A resumed run's trigger starts with an empty window (step 101 after a checkpoint at 100)."""
    from deepspeed_patch.spikes.spike_rule import WARM_UP

    assert SpikeTrigger(3.0, 50, 4, on_overflow=True).update(101, None, True)["fired_at"] == 101
    trigger = SpikeTrigger(norm_ratio=3.0, window=50, capture_steps=4, on_overflow=True)
    warm_up = [1.0, 1.0, 50.0, 1.0, 1.0]  # a spike at step 103, within the warm-up: not judged
    assert len(warm_up) == WARM_UP
    assert [trigger.update(101 + index, norm, False) for index, norm in enumerate(warm_up)] == [None] * WARM_UP
    assert trigger.update(106, 9.0, False)["fired_at"] == 106  # 9 > 3 x median 1


def test_dump_rotates(tmp_path):
    dump = JsonlDump(str(tmp_path / "d.jsonl"), max_bytes=1024, backups=2)
    for step in range(100):
        dump.write({"step": step, "pad": "x" * 100})
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl", "d.jsonl.1", "d.jsonl.2"]
    assert all(os.path.getsize(tmp_path / name) <= 1024 for name in os.listdir(tmp_path))


def test_dump_survives_a_killed_process_up_to_its_last_full_line(tmp_path):
    path = tmp_path / "killed.jsonl"
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys\nfrom deepspeed_patch.outputs.jsonl_dump import JsonlDump\n"
        f"dump = JsonlDump({str(path)!r}, max_bytes=10**9, backups=0)\n"
        "step = 0\nwhile True:\n    dump.write({'step': step, 'pad': 'x' * 1000}); step += 1\n")])
    deadline = time.time() + 60
    while (not path.exists() or path.stat().st_size < 200_000) and time.time() < deadline:
        time.sleep(0.1)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    lines = path.read_text().split("\n")
    complete = [json.loads(line) for line in lines[:-1]]
    assert len(complete) >= 100
    assert [record["step"] for record in complete] == list(range(len(complete)))


def one_rank_extrema(gradient: torch.Tensor) -> Dict[str, float]:
    """min, max, abs_min and abs_max of a whole gradient in plain PyTorch (NaN propagates, as in amax)."""
    return {"min": gradient.amin().item(), "max": gradient.amax().item(), "abs_min": gradient.abs().amin().item(),
            "abs_max": gradient.abs().amax().item()}


def test_nan_and_inf_reduce_over_gloo_as_on_one_rank_whichever_rank_holds_them(runs):
    from deepspeed_patch.statistics.statistics import bucket_results

    _, ranks = runs
    assert repr(ranks[0]["nan"]["reduced"]) == repr(ranks[1]["nan"]["reduced"])
    checked = 0
    for name, pieces in NAN_CASES.items():
        reduced = bucket_results(ranks[0]["nan"]["reduced"][name][:-1], [0], [0], 1.0)[0]
        expected = one_rank_extrema(torch.tensor(pieces[0] + pieces[1], dtype=torch.float32))
        for stat, value in expected.items():
            assert repr(reduced[stat]) == repr(value), (name, stat, reduced[stat], value)
            checked += 1
    assert checked == 4 * len(NAN_CASES)
    at_rank_0, at_rank_1 = (ranks[0]["nan"]["reduced"][f"nan_on_rank_{rank}"] for rank in (0, 1))
    assert repr(at_rank_0) == repr(at_rank_1)


@pytest.mark.extended  # the overflow policy's unit tests below run in the suite
def test_routine_loss_scale_growth_overflows_do_not_fire(extended_runs):
    _, (first, second) = extended_runs
    growth = first["scale_growth"]
    assert repr(growth) == repr(second["scale_growth"])
    overflows = [step for step, overflow in enumerate(growth["overflow"], 1) if overflow]
    # skipped steps, two of them in a row (the grown scale, then hysteresis): the old policy fired at the first
    assert len(overflows) >= 2 and any(later - earlier == 1 for earlier, later in zip(overflows, overflows[1:]))
    assert growth["history"] == [None] * 20 and growth["measured"] == [None] * 20


def fires_of(trigger: SpikeTrigger, norms, overflows=()) -> List[int]:
    """The steps at which ``trigger`` fires over ``norms`` (step 1 first; ``overflows``: skipped steps)."""
    fired = [trigger.update(step, norm, step in overflows) for step, norm in enumerate(norms, 1)]
    return [record["fired_at"] for record in fired if record is not None]


def test_a_sustained_spike_fires_once_per_cooldown():
    norms = [1.0] * 10 + [50.0] * 10
    assert fires_of(SpikeTrigger(3.0, 50, 2, True), norms) == list(range(11, 21))  # no cooldown: every step
    assert fires_of(SpikeTrigger(3.0, 50, 2, True, cooldown=4), norms) == [11, 15, 19]


def test_overflow_fires_after_its_run_of_skipped_steps_and_never_during_the_start_up_search():
    norms = [1.0] * 30
    trigger = SpikeTrigger(3.0, 5, 2, True, cooldown=3, overflow_steps=3)
    # steps 1-4: the start-up search; 10, 11: a grown scale (two in a row); 20-25: a divergence
    assert fires_of(trigger, norms, {1, 2, 3, 4, 10, 11, 20, 21, 22, 23, 24, 25}) == [22, 25]
    assert fires_of(SpikeTrigger(3.0, 5, 2, False, overflow_steps=1), norms, {5, 6, 7}) == []  # on_overflow off
    resumed = SpikeTrigger(3.0, 5, 2, True, overflow_steps=2)  # a resumed run's skipped steps count at once
    assert [resumed.update(step, None, True) is not None for step in (101, 102)] == [False, True]


def test_config_defaults_of_the_trigger_policy():
    trigger = load_config({"layer_grad_norms": {"trigger": {"capture_steps": 5}}}).trigger
    assert (trigger.overflow_steps, trigger.refractory_steps()) == (3, 6)
    trigger = load_config({"layer_grad_norms": {"trigger": {"capture_steps": 5, "history": 32}}}).trigger
    assert trigger.refractory_steps() == 32
    assert load_config({"layer_grad_norms": {"trigger": {"cooldown": 1}}}).trigger.refractory_steps() == 1


@pytest.mark.parametrize("key,value", [("cooldown", 0), ("cooldown", "long"), ("overflow_steps", 0),
                                       ("overflow_steps", 1.5)])
def test_bad_trigger_policy_keys_are_named(key, value):
    with pytest.raises(LayerGradNormsConfigError, match=f"layer_grad_norms.trigger.{key}={value!r}"):
        load_config({"layer_grad_norms": {"trigger": {key: value}}})


def test_a_non_finite_norm_no_loss_scaler_skipped_fires_at_once():
    """bf16 or fp32: no scaler skips the step, so a NaN or inf norm is no routine overflow."""
    trigger = SpikeTrigger(3.0, 5, 2, on_overflow=True, overflow_steps=3)
    assert trigger.update(1, 1.0, False) is None
    assert trigger.update(2, math.nan, False)["reason"] == "grad norm nan"
    assert SpikeTrigger(3.0, 5, 2, True, overflow_steps=3).update(4, math.inf, False)["reason"] == "grad norm inf"


def test_a_trigger_on_the_loss_alone_never_reads_the_global_norm():
    """``grad_norm_factor: null`` with a ``loss_factor`` and a host loss: the trigger reads nothing from the
    device (the norm is never converted), and a loss spike still fires."""
    from deepspeed_patch.config import TriggerConfig
    from deepspeed_patch.spikes.trigger import TriggerState

    class Unreadable:

        def __float__(self):
            raise AssertionError("the global norm was read")

    state = TriggerState(TriggerConfig(grad_norm_factor=None, loss_factor=2.0, window=5, capture_steps=1))
    fired = []
    for step, loss in enumerate([1.0, 1.1, 0.9, 1.0, 1.05, 1.0, 9.0], start=1):
        state.loss.report(loss)
        fired.append(state.after_step(step, Unreadable(), False))
    assert fired[:-1] == [None] * 6
    assert fired[-1]["fired_at"] == 7 and fired[-1]["reason"].startswith("loss 9")


@pytest.mark.extended  # the agreed loss itself over 2 ranks is the suite's (the next test)
def test_ranks_reporting_their_own_losses_make_one_decision(extended_runs):
    """A loop that reports each rank's own loss (rank 1's spiking), or a loss on one rank only: the run goes on,
    every rank fires at the same step on the largest loss reported, with the same recorded steps; the loss costs
    one all-reduce on every step the trigger watches it, and the fire its ring's and the capture's reductions."""
    _, (first, second) = extended_runs
    assert repr(first["own_losses"]) == repr(second["own_losses"])
    checked = 0
    for name in ("every_rank", "rank_1_only"):
        run = first["own_losses"][name]
        assert list(run["fires"]) == [OWN_LOSS_SPIKE], name
        (history, ) = run["fires"].values()
        assert [entry["step"] for entry in history] == list(range(OWN_LOSS_SPIKE - 3, OWN_LOSS_SPIKE + 1))
        assert history[-1]["trigger"]["reason"].startswith("loss"), history[-1]["trigger"]
        baseline = first["own_losses"]["no_loss_factor"]["collectives"]
        added = [with_loss - without for with_loss, without in zip(run["collectives"], baseline)]
        assert added == [1 + 2 * (step in (OWN_LOSS_SPIKE, OWN_LOSS_SPIKE + 1)) for step in range(1, 11)], name
        checked += 1
    assert checked == 2
    assert first["own_losses"]["no_loss_factor"]["fires"] == {}


def test_the_loss_judged_is_the_largest_reported_and_a_non_finite_one_wins(runs):
    """Over the real 2-rank group: the largest of the losses reported (a device tensor or a float), ``-inf`` where no
    rank reported one (judged as none), NaN wherever a rank's loss is NaN or ``-inf``, +inf over finite losses."""
    _, (first, second) = runs
    assert repr(first["agreed_losses"]) == repr(second["agreed_losses"])
    assert len(first["agreed_losses"]) == len(AGREED_LOSSES) == 7
    for name, (_, expected) in AGREED_LOSSES.items():
        assert repr(first["agreed_losses"][name]) == repr(expected), name
