"""LayerGradNormsCallback in a real Hugging Face Trainer run: a tiny GPT-2 built from a config, a few
steps, under DeepSpeed ZeRO-2 (and ZeRO-3) on 2 CPU ranks, and without DeepSpeed in one process.

What is checked: every bucket is logged at every logging step, in ``trainer.state.log_history`` and in
the Trainer's TensorBoard integration; the pre-clip norms add up to the Trainer's logged ``grad_norm``;
under DeepSpeed the values are the engine's ``get_layer_grad_norms()`` of that step; without DeepSpeed
they match the gradient before the Trainer clipped it (tests/reference.py), post-clip after it.
"""

import ast
import math
import os
import subprocess
from functools import lru_cache

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from deepspeed_patch.hf import LayerGradNormsCallback  # noqa: E402
from deepspeed_patch.outputs.tags import flat_scalars, scalar_tag  # noqa: E402
from hf_workers import FAULTY_STEP, MAX_GRAD_NORM, STEPS, run, run_deepspeed_cases  # noqa: E402
from megatron_integration.cpu_launch import launch  # noqa: E402

pytestmark = pytest.mark.extended  # CI runs it in its extended pass (tests/README.md)

STATISTICS = ("norm", "min", "max")
BUCKETS = {"layer00", "layer01", "layer02", "transformer.wte", "transformer.wpe", "transformer.ln_f"}
DEEPSPEED_CASES = {
    "zero2": {"stage": 2, "block": {"enabled": True}, "gas": 2, "options": {"statistics": STATISTICS}},
    "zero3": {"stage": 3, "block": {"enabled": True}, "options": {"statistics": STATISTICS}},
    # the zero2 case's callback again, in a second Trainer: it must not read the first run's engine
    "zero2_without_block": {"stage": 2, "block": None, "reuse": "zero2"},
    "zero2_interval_2": {"stage": 2, "block": {"enabled": True, "interval": 2}},
    "zero2_kinds_selected": {"stage": 2, "block": {"enabled": True, "optimizer_statistics": ["param", "update"]},
                             "options": {"phases": ("update", "update_to_weight"), "statistics": ("norm", "max")}},
}
TOLERANCE = 1e-5


@lru_cache(maxsize=None)
def deepspeed_runs():
    return launch(run_deepspeed_cases, 2, DEEPSPEED_CASES)


@lru_cache(maxsize=None)
def plain_run(added_late: bool = False):
    return run(None, {"statistics": STATISTICS}, added_late=added_late)


def deepspeed_record(name: str, rank: int = 0):
    record = deepspeed_runs()[rank][name]
    if "error" in record:
        pytest.fail(record["error"])
    return record


def training_logs(record):
    logs = [entry for entry in record["log_history"] if "grad_norm" in entry]
    assert [entry["step"] for entry in logs] == list(range(1, STEPS + 1))
    return logs


def pre_clip_norms(entry):
    prefix = scalar_tag("pre_clip", "norm") + "/"
    return {tag[len(prefix):]: value for tag, value in entry.items() if tag.startswith(prefix)}


def assert_norms_add_up(record):
    checked = 0
    for entry in training_logs(record):
        norms = pre_clip_norms(entry)
        assert set(norms) == BUCKETS
        assert math.sqrt(sum(value**2 for value in norms.values())) == pytest.approx(entry["grad_norm"], rel=TOLERANCE)
        checked += 1
    assert checked == STEPS


def assert_in_tensorboard(record):
    """The Trainer's own TensorBoard integration (listed before the callback) wrote every value."""
    checked = 0
    for entry in training_logs(record):
        for tag, value in entry.items():
            if tag.startswith("layer-grad-norms/"):
                assert record["tensorboard"][f"train/{tag}"][entry["step"]] == pytest.approx(value, rel=1e-6)
                checked += 1
    assert checked == STEPS * len(BUCKETS) * 2 * len(STATISTICS)


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_deepspeed_logs_every_layer_adding_up_to_grad_norm(name):
    assert_norms_add_up(deepspeed_record(name))


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_deepspeed_values_are_the_engines_of_that_step(name):
    record = deepspeed_record(name)
    results = record["engine_results"]
    assert [result["step"] for result in results] == list(range(1, STEPS + 1))
    for entry, result in zip(training_logs(record), results):
        expected = flat_scalars(result, statistics=STATISTICS)
        assert {tag: entry[tag] for tag in expected} == expected
        assert sum(tag.startswith("layer-grad-norms/") for tag in entry) == len(expected)


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_deepspeed_values_reach_tensorboard(name):
    assert_in_tensorboard(deepspeed_record(name))


def test_deepspeed_same_logs_on_every_rank():
    assert training_logs(deepspeed_record("zero2", 1)) == training_logs(deepspeed_record("zero2", 0))


def test_missing_block_warns_once():
    """In a second Trainer run with the first run's callback: its engine, whose last result is of step 3 too,
    is not read."""
    assert deepspeed_record("zero2")["engine_results"][-1]["step"] == STEPS
    record = deepspeed_record("zero2_without_block")
    assert len(record["warnings"]) == 1
    assert "no 'layer_grad_norms' block" in record["warnings"][0]
    assert not any(tag.startswith("layer-grad-norms/") for entry in record["log_history"] for tag in entry)


def test_logging_steps_not_a_multiple_of_the_interval_warns_once():
    """``logging_steps=1``, ``interval: 2``: one warning; only step 2 logs, the engine's values of step 2."""
    record = deepspeed_record("zero2_interval_2")
    assert record["warnings"] == ["LayerGradNormsCallback: logging_steps=1 is not a multiple of the "
                                  "'layer_grad_norms' block's interval=2: only the steps that are multiples of 2 log "
                                  "the statistics; make logging_steps a multiple of the interval"]
    logged = [entry for entry in training_logs(record) if any(tag.startswith("layer-grad-norms/") for tag in entry)]
    assert [entry["step"] for entry in logged] == [2]
    assert [result and result["step"] for result in record["engine_results"]] == [None, 2, 2]
    expected = flat_scalars(record["engine_results"][1], statistics=("norm", ))  # the callback's default
    assert {tag: logged[0][tag] for tag in expected} == expected
    assert sum(tag.startswith("layer-grad-norms/") for tag in logged[0]) == len(expected)


def test_selected_optimizer_phases_are_logged_alone():
    """``phases``: the update's norm and max and the update-to-weight ratio, the engine's of each step."""
    record = deepspeed_record("zero2_kinds_selected")
    for entry, result in zip(training_logs(record), record["engine_results"]):
        logged = {tag: value for tag, value in entry.items() if tag.startswith("layer-grad-norms/")}
        assert logged == flat_scalars(result, ("update", "update_to_weight"), ("norm", "max"))
        assert len(logged) == 3 * len(BUCKETS)
        assert logged["layer-grad-norms/update-to-weight/layer01"] == pytest.approx(
            result["update"][1]["norm"] / result["param"][1]["norm"])
    with pytest.raises(ValueError, match=r"phases=\('momentum',\)\): choose from pre_clip, post_clip, param, update"):
        LayerGradNormsCallback(phases=("momentum", ))


def test_plain_logs_every_layer_adding_up_to_grad_norm():
    assert_norms_add_up(plain_run())


def test_plain_pre_clip_matches_the_gradient_before_the_trainer_clipped_it():
    record = plain_run()
    checked = 0
    for entry, reference in zip(training_logs(record), record["reference"]):
        total = math.sqrt(sum(stats["norm"]**2 for stats in reference.values()))
        clip_coef = min(1.0, MAX_GRAD_NORM / (total + 1e-6))
        assert clip_coef < 0.1  # the Trainer clipped
        for key, stats in reference.items():
            for statistic in STATISTICS:
                scale = stats["norm" if statistic == "norm" else "abs_max"]
                pre = entry[scalar_tag("pre_clip", statistic, key)]
                post = entry[scalar_tag("post_clip", statistic, key)]
                assert abs(pre - stats[statistic]) <= TOLERANCE * scale, (key, statistic)
                assert abs(post - stats[statistic] * clip_coef) <= TOLERANCE * scale * clip_coef, (key, statistic)
                checked += 1
    assert checked == STEPS * len(BUCKETS) * len(STATISTICS)


def test_plain_values_reach_tensorboard():
    assert_in_tensorboard(plain_run())


def test_plain_added_after_the_trainer_was_built_still_reaches_tensorboard():
    """``trainer.add_callback`` puts the callback behind the report_to integrations; it moves ahead of them."""
    record = plain_run(added_late=True)
    assert record["warnings"] == []
    assert_norms_add_up(record)
    assert_in_tensorboard(record)


PLAIN_VARIANTS = {"without the callback": None, "console": {"statistics": STATISTICS, "console": True},
                  "faulty": {"statistics": STATISTICS, "fault": True}}


@lru_cache(maxsize=None)
def plain_variant(name: str, output_root=None):
    record = run(None, PLAIN_VARIANTS[name], output_root=output_root)
    if "error" in record:
        pytest.fail(record["error"])
    return record


def console_lines(record):
    """The Trainer's console line of each training step, as printed."""
    lines = [line for line in record["console"] if line.startswith("{'loss'")]
    assert len(lines) == STEPS
    return lines


def test_the_console_line_is_the_trainers_own_by_default():
    """Without DeepSpeed: the very lines printed without the callback (its values still reach the logs and
    TensorBoard: the tests above); under DeepSpeed: the Trainer's own keys alone."""
    without = console_lines(plain_variant("without the callback"))
    assert console_lines(plain_run()) == without
    assert "layer-grad-norms" not in "".join(without)
    keys = [set(ast.literal_eval(line)) for line in without]
    assert keys == [{"loss", "grad_norm", "learning_rate", "epoch"}] * STEPS
    assert [set(ast.literal_eval(line)) for line in console_lines(deepspeed_record("zero2"))] == keys
    assert len(deepspeed_record("zero2", 1)["console"]) == 0  # printed on the local process zero only


def test_the_console_prints_a_summary_of_the_values_when_asked():
    """One short entry, the largest and the smallest bucket's pre-clip norm; every value in the logs."""
    from deepspeed_patch.outputs.hf_readers import SUMMARY_KEY

    record = plain_variant("console")
    checked = 0
    for line, entry in zip(console_lines(record), training_logs(record)):
        printed = ast.literal_eval(line)
        values = {tag: value for tag, value in entry.items() if tag.startswith("layer-grad-norms/")}
        assert len(values) == len(BUCKETS) * 2 * len(STATISTICS) and SUMMARY_KEY not in entry
        assert set(printed) == set(entry) - {"step"} - set(values) | {SUMMARY_KEY}
        norms = {tag.rsplit("/", 1)[1]: value for tag, value in values.items()
                 if tag.startswith("layer-grad-norms/pre-clip/")}
        largest, smallest = max(norms, key=norms.get), min(norms, key=norms.get)
        assert printed[SUMMARY_KEY] == (f"max {largest} {norms[largest]:.3e}, min {smallest} "
                                        f"{norms[smallest]:.3e}") and len(line) < 200, line
        checked += 1
    assert checked == STEPS
    with pytest.raises(ValueError, match=r"LayerGradNormsCallback\(console='yes'\): must be True or False"):
        LayerGradNormsCallback(console="yes")


def test_a_failing_callback_stops_itself_alone_logged_once():
    """Its reading of the values raises at step 2: one traceback; training and the Trainer's logs go on, the
    values of step 1 stay, none after."""
    record = plain_variant("faulty")
    assert record["failures"] == [f"layer_grad_norms: LayerGradNormsCallback's logging failed at step {FAULTY_STEP} "
                                  "on rank 0; it is switched off on this rank, training, the statistics and the "
                                  "other readers go on"]
    logged = [any(tag.startswith("layer-grad-norms/") for tag in entry) for entry in training_logs(record)]
    assert logged == [True, False, False]
    assert sorted(step for tag, steps in record["tensorboard"].items() if tag == "train/loss" for step in steps) == [
        1, 2, 3]


@pytest.fixture
def full_disk(tmp_path):
    """A tmpfs of 8 KiB (as root): the Trainer's own TensorBoard log of the run fits (5.5 kB), not with the
    values (15 kB)."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to mount a small tmpfs")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(tmp_path)], check=True)
    yield str(tmp_path)
    subprocess.run(["umount", str(tmp_path)], check=True)


# TensorBoard's own writer thread meets the full disk too, and raises there (OSError 28): the fault this test makes.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_full_disk_under_the_trainers_tensorboard_stops_that_integration_alone_logged_once(full_disk):
    """The values fill the disk of the Trainer's TensorBoard log: its integration stops, once, on a log holding
    them; training, the logs and ``log_history`` go on. Without the callback the same disk holds the run."""
    record = run(None, {"statistics": STATISTICS}, output_root=full_disk)
    assert "error" not in record, record.get("error")
    (message, ) = record["failures"]
    assert message.startswith("layer_grad_norms: the Trainer's TensorBoardCallback failed at step ")
    assert message.endswith(" on rank 0; it is switched off on this rank, training, the statistics and the other "
                            "readers go on")
    assert_norms_add_up(record)  # every step's values in log_history
    assert console_lines(record) == console_lines(plain_variant("without the callback"))
    subprocess.run(["rm", "-rf", *[os.path.join(full_disk, name) for name in os.listdir(full_disk)]], check=True)
    without = run(None, None, output_root=full_disk)
    assert "error" not in without and without["failures"] == [] and len(without["tensorboard"]["train/loss"]) == STEPS
