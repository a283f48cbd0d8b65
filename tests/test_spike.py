"""Where a fire's recorded steps go and what ``report`` and ``plot --history`` make of them, on results built here
with known values: the hook's TensorBoard runs per fire, the JSONL dump's ``"history": true`` lines."""

import json
import math
import os
from functools import lru_cache
from typing import Dict, List

import numpy as np
import pytest
from adam_dynamics import Cause, Run, fire_of, train

from deepspeed_patch.outputs.jsonl_dump import JsonlDump
from deepspeed_patch.outputs.tags import (
    ALL_PHASES,
    HISTORY_ROOT,
    UPDATE_TO_WEIGHT,
    history_run_name,
    logged_result,
    run_name,
    scalar_tag,
)
from megatron_integration.arguments import add_layer_grad_norms_args
from megatron_integration.cli import main
from megatron_integration.fires import Fire, read_fires
from megatron_integration.plot import plot_spike_history
from megatron_integration.spike import LINE_WIDTH, MOMENTS, THRESHOLDS, format_spikes, localise, localise_all, verdicts
from megatron_integration.tensorboard_reader import read_layer_series
from megatron_integration.training_log import log_layer_grad_norms

LAYERS = 6
SELECTED = [0, 3]
FIRE = 10
SPIKED = {(4, 9): 2.5, (4, 10): 20.0, (2, 10): 3.0}
"""Layer 4 rises first (2.5x its own norm at step 9) and most (20x at step 10, the fire); layer 2 only at the fire."""


def base_norm(layer: int) -> float:
    return 1.0 + 0.5 * layer


def result(step: int, keys: List, spiked: Dict = None, fired_at: int = None) -> Dict:
    """The engine's result for ``keys`` (``"embed"`` a bucket outside the layers): each layer's own constant norm,
    times its ``spiked`` factor at this step; with the trigger's record of a fire at ``fired_at``."""
    def stats(key, factor: float) -> Dict[str, float]:
        norm = (base_norm(key) if isinstance(key, int) else 0.25) * (spiked or {}).get((key, step), 1.0) * factor
        return {"norm": norm, "min": -norm / 8, "max": norm / 8}

    entry = {"step": step, "overflow": False, "clip_coef": 0.5, "pre_clip": {key: stats(key, 1.0) for key in keys},
             "post_clip": {key: stats(key, 0.5) for key in keys}}
    if fired_at is not None:
        entry["trigger"] = {"fired_at": fired_at, "reason": "grad norm 9 > 3.0 x median 1", "capture_until": 30}
    return entry


def history(fired_at: int, spiked: Dict, length: int = 8) -> List[Dict]:
    """``get_layer_grad_norms_history()`` at a fire: every bucket of the last ``length`` steps, oldest first."""
    keys = list(range(LAYERS)) + ["embed"]
    return [result(step, keys, spiked, fired_at) for step in range(fired_at - length + 1, fired_at + 1)]


class RecordingEngine:
    """The engine's side of the hook's contract with a flight recorder: the last result and the last fire's steps."""

    def __init__(self) -> None:
        self.stats, self.recorded = None, None

    def get_layer_grad_norms(self):
        return self.stats

    def get_layer_grad_norms_history(self):
        return self.recorded


def scalar_points(logdir: str, run: str, tag: str) -> List:
    """``(step, value)`` of one run's tag as TensorBoard reads it, orphaned-data purging on (its default)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(os.path.join(logdir, run), size_guidance={"scalars": 0}, purge_orphaned_data=True)
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def unwrapped(text: str) -> List[str]:
    """The report's lines as written before they were wrapped: each line at most ``LINE_WIDTH`` characters, a line
    indented 4 more than the one before continues it."""
    lines: List[str] = []
    indents: List[int] = []
    for line in text.splitlines():
        assert len(line) <= LINE_WIDTH, line
        indent = len(line) - len(line.lstrip(" "))
        if lines and indent == indents[-1] + 4:
            lines[-1] += " " + line.lstrip(" ")
        else:
            lines.append(line)
            indents.append(indent)
    return lines


def test_a_fire_s_steps_go_to_runs_of_their_own_and_nothing_written_disappears(tmp_path):
    """Steps 1 to 14 logged live, fires at 10 (steps 3 to 10 recorded) and 14 (7 to 14): every live point is still
    there when read back as TensorBoard reads it, and each fire's points are in its runs, written once."""
    import argparse

    from torch.utils.tensorboard import SummaryWriter

    args = add_layer_grad_norms_args(argparse.ArgumentParser()).parse_args(["--log-layer-grad-norms"])
    engine, logdir = RecordingEngine(), str(tmp_path)
    fires = {FIRE: history(FIRE, SPIKED), 14: history(14, {(1, 14): 5.0})}
    with SummaryWriter(logdir) as writer:
        for iteration in range(1, 15):
            engine.stats = result(iteration, SELECTED, SPIKED)
            engine.recorded = fires.get(iteration, engine.recorded)
            for _ in range(2):  # read twice: each result and each fire written once
                log_layer_grad_norms(engine, iteration, writer, args)
    checked = 0
    for layer in SELECTED:
        for phase, factor in (("pre-clip", 1.0), ("post-clip", 0.5)):
            expected = [(step, pytest.approx(base_norm(layer) * SPIKED.get((layer, step), 1.0) * factor))
                        for step in range(1, 15)]
            assert scalar_points(logdir, run_name(layer), f"layer-grad-norms/{phase}") == expected
            assert read_layer_series(logdir).series(phase, "norm", layer) == expected
            checked += 1
    assert checked == 4
    for fired_at, entries in fires.items():
        for key in list(range(LAYERS)) + ["embed"]:
            root = "layer-grad-norms-history" if isinstance(key, int) else "non-layer-grad-norms-history"
            run = history_run_name(fired_at, key)
            assert scalar_points(logdir, run, f"{root}/pre-clip") == [
                (entry["step"], pytest.approx(entry["pre_clip"][key]["norm"])) for entry in entries]
            assert scalar_points(logdir, run, f"{root}/values/max/post-clip") == [
                (entry["step"], pytest.approx(entry["post_clip"][key]["max"])) for entry in entries]
            assert len(os.listdir(os.path.join(logdir, run))) == 1  # one event file: written once
            checked += 1
    assert checked == 4 + 2 * (LAYERS + 1)


def write_dump(path: str) -> None:
    """Live lines of steps 1 to 12 (the selected layers, then every layer while capturing from the fire on), and the
    fire's recorded steps; before them, a first writing of the same fire (a run rolled back past it) that blamed
    layer 2."""
    dump = JsonlDump(path, max_bytes=10**7, backups=0)
    for step in range(1, FIRE + 1):
        dump.write(result(step, SELECTED, SPIKED))
    for entries in (history(FIRE, {(2, 10): 50.0}), history(FIRE, SPIKED)):
        for entry in entries:
            dump.write({**entry, "history": True})
    for step in range(FIRE + 1, 13):
        dump.write(result(step, list(range(LAYERS)), SPIKED, fired_at=FIRE))


def write_tensorboard_log(logdir: str) -> None:
    from torch.utils.tensorboard import SummaryWriter

    from megatron_integration.training_log import write_history, write_tensorboard

    with SummaryWriter(logdir) as writer:
        for step in range(1, 13):
            write_tensorboard(writer, result(step, SELECTED, SPIKED))
        write_history(writer, history(FIRE, SPIKED))


@pytest.fixture(params=["dump", "tensorboard"])
def source(request, tmp_path) -> str:
    if request.param == "dump":
        write_dump(str(tmp_path / "dump.jsonl"))
        return str(tmp_path / "dump.jsonl")
    write_tensorboard_log(str(tmp_path))
    return str(tmp_path)


def test_report_localises_the_spike_to_the_layer_that_rose_first_and_most(source, capsys):
    """Against each layer's own constant norm: layer 4 is 20x at the fire and above 2x from step 9, layer 2 is 3x at
    the fire only, the others 1x."""
    main(["report", source, "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == [1, 12]
    (spike,) = summary["spikes"]
    assert spike["fired_at"] == FIRE and spike["steps"] == [3, 10]
    assert spike["rose_most"] == 4 and spike["rose_first"] == [4] and spike["first_step"] == 9
    checked = 0
    for layer, rise in spike["layers"].items():
        layer = int(layer)
        assert rise["baseline"] == pytest.approx(base_norm(layer))
        assert rise["rise_at_fire"] == pytest.approx(SPIKED.get((layer, FIRE), 1.0))
        assert rise["first_risen"] == {4: 9, 2: 10}.get(layer)
        checked += 1
    assert checked == LAYERS
    assert spike["answer"].startswith(f"spike at step {FIRE}")
    assert f"layer 4 rose most, 20.0x its median at step {FIRE}; first above 2x: layer 4 at step 9" in spike["answer"]
    main(["report", source])
    text = capsys.readouterr().out
    assert unwrapped(text)[-1] == spike["answer"]
    assert f"spike: the trigger fired at step {FIRE}, recorded steps 3-10" in text


def test_plot_history_draws_every_layer_of_each_fire(source, tmp_path, capsys):
    output = str(tmp_path / "history.svg")
    main(["plot", source, "--history", "-o", output])
    assert capsys.readouterr().out.strip() == f"figure: {output}"
    with open(output) as figure:
        assert "<svg" in figure.read(2000)
    fires = read_fires(source)
    figure = plot_spike_history(fires, [localise(fire) for fire in fires], str(tmp_path / "history.png"))
    norm_axis, rise_axis = figure.axes[:2]
    lines = norm_axis.get_lines()
    assert len(lines) == LAYERS + 1  # every layer, and the fire's mark
    assert [line.get_label() for line in lines if line.get_linewidth() > 2] == ["layer 4"]  # the one that rose most
    assert rise_axis.images[0].get_array().shape == (LAYERS, 8)


def test_plot_history_without_a_fire_says_so(tmp_path, capsys):
    path = str(tmp_path / "dump.jsonl")
    JsonlDump(path, max_bytes=10**6, backups=0).write(result(1, SELECTED))
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", path, "--history"])
    assert exit_info.value.code == 2
    assert "no fire of the trigger with a flight recorder" in capsys.readouterr().err


# Localisation on recorded steps built here, each layer's norms varying from step to step: the expected rises come from
# numpy's median of the layer's own finite norms before the fire.
RECORDED = range(3, FIRE + 1)


def varying(layer: int, step: int) -> float:
    """A layer's norm without a spike: its own level, up to 60% above it, changing every step."""
    return base_norm(layer) * (1.0 + 0.15 * ((7 * step + 3 * layer) % 5))


def recorded_fire(norms: Dict, steps=RECORDED, reason: str = None) -> Fire:
    """A fire at ``FIRE`` whose recorded steps are ``steps``; ``norms[(layer, step)]`` replaces the varying norm."""
    return Fire(FIRE, reason, {"pre_clip": {layer: [(step, norms.get((layer, step), varying(layer, step)))
                                                    for step in steps] for layer in range(LAYERS)}})


def expected_rises(fire: Fire) -> Dict:
    """Per layer: its baseline and its rise at each finite step, computed independently of ``spike``."""
    rises = {}
    for layer, points in fire.norms.items():
        baseline = float(np.median([value for step, value in points if step < FIRE and np.isfinite(value)]))
        rises[layer] = (baseline, {step: value / baseline for step, value in points if np.isfinite(value)})
    return rises


def test_localise_judges_each_layer_against_its_own_varying_median():
    """Layer 4 is 2.5x its varying norm at step 8 and 12x at the fire, layer 1 4x at the fire: layer 4 rose first
    and most, by numpy's median of its own norms before the fire."""
    spiked = {(4, 8): 2.5 * varying(4, 8), (4, FIRE): 12 * varying(4, FIRE), (1, FIRE): 4 * varying(1, FIRE)}
    fire = recorded_fire(spiked)
    spike = localise(fire)
    expected = expected_rises(fire)
    checked = 0
    for layer, (baseline, rises) in expected.items():
        rise = spike["layers"][layer]
        assert rise["baseline"] == pytest.approx(baseline, rel=1e-12)
        assert rise["rise_at_fire"] == pytest.approx(rises[FIRE], rel=1e-12)
        peak_step = max(rises, key=lambda step: (rises[step], -step))
        assert (rise["peak_step"], rise["peak_rise"]) == (peak_step, pytest.approx(rises[peak_step], rel=1e-12))
        assert rise["first_risen"] == next((step for step in sorted(rises) if rises[step] > 2), None)
        checked += 1
    assert checked == LAYERS
    assert spike["rose_most"] == 4 and spike["rose_first"] == [4] and spike["first_step"] == 8
    assert spike["nonfinite_first"] == [] and spike["nonfinite_step"] is None
    peak = expected[4][1][FIRE]
    assert spike["answer"] == (f"spike at step {FIRE}: layer 4 rose most, {peak:.1f}x its median at step {FIRE}; "
                               "first above 2x: layer 4 at step 8")
    assert any(rise > 2 for rise in expected[1][1].values())  # layer 1 rose too, less


def test_a_layer_gone_non_finite_is_named_before_the_largest_rise():
    """Layer 1 is NaN from step 9, layer 3 inf at the fire, layer 4 50x at the fire: layer 1 is named, although its
    rise cannot be measured and layer 4 rose most among the finite norms."""
    nan, inf = float("nan"), float("inf")
    fire = recorded_fire({(1, 9): nan, (1, FIRE): nan, (3, FIRE): inf, (4, FIRE): 50 * varying(4, FIRE)},
                       reason="overflow")
    spike = localise(fire)
    assert spike["nonfinite_first"] == [1] and spike["nonfinite_step"] == 9
    assert [spike["layers"][layer]["first_nonfinite"] for layer in range(LAYERS)] == [None, 9, None, FIRE, None, None]
    assert spike["rose_most"] == 4  # still reported, in the table
    assert spike["answer"] == (f"spike at step {FIRE} (overflow): layer 1 went non-finite first, at step 9 "
                               f"(2 of {LAYERS} layers non-finite by the fire)")
    assert math.isnan(spike["layers"][1]["rise_at_fire"]) and math.isinf(spike["layers"][3]["rise_at_fire"])
    text = format_spikes([spike], shown=3)
    assert [line.split(":")[0].strip() for line in unwrapped(text)[1:4]] == ["layer 1", "layer 3", "layer 4"]
    assert "non-finite from step 9" in unwrapped(text)[1]


def test_a_rise_from_a_zero_baseline_is_infinite():
    """Layer 2's gradient was exactly zero before the fire (a frozen or unused layer) and is 0.01 at the fire: an
    infinite rise, above layer 4's 30x; layer 5, zero throughout, did not rise."""
    zeros = {(layer, step): 0.0 for layer in (2, 5) for step in RECORDED}
    fire = recorded_fire({**zeros, (2, FIRE): 0.01, (4, FIRE): 30 * varying(4, FIRE)})
    spike = localise(fire)
    two, five = spike["layers"][2], spike["layers"][5]
    assert two["baseline"] == 0 and math.isinf(two["peak_rise"]) and two["peak_step"] == FIRE
    assert two["first_risen"] == FIRE and math.isinf(two["rise_at_fire"])
    assert five["baseline"] == 0 and five["peak_rise"] == 1.0 and five["first_risen"] is None
    assert spike["rose_most"] == 2 and spike["rose_first"] == [2, 4]
    assert spike["answer"] == (f"spike at step {FIRE}: layer 2 rose most, from a zero median at step {FIRE}; "
                               f"first above 2x: layer 2, layer 4 at step {FIRE}")


@pytest.mark.parametrize("before", [0, 1, 2])
def test_a_baseline_shorter_than_three_steps_is_refused(before):
    """With ``before`` steps recorded before the fire, no layer is judged, and the answer says why."""
    fire = recorded_fire({(4, FIRE): 40 * varying(4, FIRE)}, steps=range(FIRE - before, FIRE + 1))
    spike = localise(fire)
    assert spike["rose_most"] is None and spike["rose_first"] == [] and spike["first_step"] is None
    assert all(math.isnan(rise["baseline"]) for rise in spike["layers"].values())
    assert spike["answer"] == (f"spike at step {FIRE}: the baseline is too short: at most {before} finite norms of a "
                               "layer before the fire, 3 needed (a longer trigger.history keeps more)")
    text = format_spikes([spike])
    assert f"baseline too short ({before} finite norms before the fire, 3 needed)" in text
    judged = localise(recorded_fire({(4, FIRE): 40 * varying(4, FIRE)}, steps=range(FIRE - 3, FIRE + 1)))
    assert judged["rose_most"] == 4  # three are enough


def write_history_only(path: str, keys: List) -> None:
    """A dump of the selected layers' live steps up to the fire, and the fire's recorded steps of ``keys`` only."""
    dump = JsonlDump(path, max_bytes=10**7, backups=0)
    for step in range(1, FIRE + 1):
        dump.write(result(step, SELECTED))
    for step in range(FIRE - 4, FIRE + 1):
        dump.write({**result(step, keys, fired_at=FIRE), "history": True})


def test_a_fire_without_layer_buckets_gets_a_clear_line(tmp_path, capsys):
    """A fire whose recorded steps hold only a bucket outside the layers: the report and the figure say so."""
    path = str(tmp_path / "dump.jsonl")
    write_history_only(path, ["embed"])
    main(["report", path, "--json"])
    (spike,) = json.loads(capsys.readouterr().out)["spikes"]
    expected = f"spike at step {FIRE} (grad norm 9 > 3.0 x median 1): no layer bucket was recorded"
    assert spike["answer"].startswith(expected) and spike["layers"] == {} and spike["steps"] == []
    main(["report", path])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == [f"spike: the trigger fired at step {FIRE}, no step recorded; pre-clip norm over each "
                          "layer's baseline:", spike["answer"]]
    output = str(tmp_path / "history.png")
    main(["plot", path, "--history", "-o", output])
    assert capsys.readouterr().out.strip() == f"figure: {output}" and os.path.getsize(output) > 0


# Which signal moved first: results with the optimizer's statistics (``optimizer_statistics``), each signal of each
# layer at its own constant level, times a factor at the steps a scenario moves it.
KIND_LEVELS = {"param": 10.0, "update": 1e-3, "exp_avg": 1e-2, "exp_avg_sq": 1e-4}
TIE_ORDER = ["pre_clip", "exp_avg", "exp_avg_sq", "update", UPDATE_TO_WEIGHT]
"""The order that breaks a tie at one step, as the issue asks: the gradient, the moments, the update, its ratio."""
AGAINST = "against the recorded steps' median"
"""These logs hold fewer than 3 steps of a layer before the recorded steps: the last resort."""
SCENARIOS = {
    "update_first": ({("update", 2, 8): 5.0, ("pre_clip", 2, 9): 4.0, ("pre_clip", 2, 10): 10.0,
                      ("exp_avg", 2, 10): 3.0},
                     f"update of layer 2 rose first (step 8) {AGAINST}, update-to-weight ratio followed (step 8), "
                     "then gradient (step 9), then exp_avg (step 10)"),
    "gradient_first": ({("pre_clip", 4, 8): 3.0, ("pre_clip", 4, 9): 6.0, ("update", 4, 9): 2.5,
                        ("update", 1, 10): 4.0},
                       f"gradient of layer 4 rose first (step 8) {AGAINST}, update followed (step 9), then "
                       "update-to-weight ratio (step 9)"),
    "below_the_signal_s_threshold": ({("exp_avg_sq", 1, 7): 2.5, ("exp_avg", 3, 7): 1.4, ("update", 1, 9): 3.0,
                                      ("pre_clip", 1, 10): 5.0, ("pre_clip", 0, 8): 1.9},
                                     f"update of layer 1 rose first (step 9) {AGAINST}, update-to-weight ratio "
                                     "followed (step 9), then gradient (step 10)"),
    "tie": ({("update", 3, 9): 8.0, ("exp_avg_sq", 0, 9): 5.0, ("pre_clip", 5, 9): 2.2, ("pre_clip", 2, 9): 3.0},
            f"gradient of layers 2, 5 (2 of 6) rose first, step 9 {AGAINST}, exp_avg_sq followed (step 9), then "
            "update (step 9), then update-to-weight ratio (step 9)"),
    "one_stands_apart": ({("pre_clip", 5, 9): 2.2, ("pre_clip", 2, 9): 4.4, ("update", 2, 10): 3.0},
                         f"gradient of layer 2 rose first (step 9) {AGAINST}, update followed (step 10), then "
                         "update-to-weight ratio (step 10)"),
    "every_layer": ({**{("update", layer, 9): 4.0 + 0.1 * layer for layer in range(LAYERS)},
                     ("pre_clip", 3, 10): 3.0},
                    f"update of every layer (6 of 6) rose first, step 9 {AGAINST}, update-to-weight ratio followed "
                    "(step 9), then gradient (step 10): this points at the optimizer step (the learning rate or its "
                    "schedule)"),
}
"""``(moves, answer)``: ``moves[(signal, layer, step)]`` multiplies that signal of that layer at that step (the
update-to-weight ratio moves with the update). Below a signal's threshold (``THRESHOLDS``) a move is no departure;
in the tie, three signals of four layers leave their level at step 9: the gradient wins, of two layers, neither
standing apart (3 < 2 x 2.2); 4.4 = 2 x 2.2 stands apart."""


def all_statistics(norm: float) -> Dict[str, float]:
    """A bucket's statistics as the engine gives them: all six, which makes a dump's lines long."""
    return {"norm": norm, "min": -norm / 8, "max": norm / 8, "abs_min": norm / 1e4, "abs_max": norm / 8,
            "nonfinite": 0}


def kinds_result(step: int, keys: List, moves: Dict, fired_at: int = None) -> Dict:
    """``result`` with every optimizer kind of every key, each moved by ``moves`` at this step; Adam's moments grow
    from zero in proportion to the step, as early in a run (``spike.MOMENTS``), their level the same per step."""
    gradient = {(layer, at): factor for (signal, layer, at), factor in moves.items() if signal == "pre_clip"}
    entry = result(step, keys, gradient, fired_at)
    for kind, level in KIND_LEVELS.items():
        growth = step if kind in MOMENTS else 1
        entry[kind] = {key: all_statistics(level * growth * (1 + 0.1 * (key if isinstance(key, int) else LAYERS)) *
                                           moves.get((kind, key, step), 1.0)) for key in keys}
    entry["pre_clip"] = {key: {**all_statistics(values["norm"]), **values}
                         for key, values in entry["pre_clip"].items()}
    return entry


def write_kinds_dump(path: str, moves: Dict) -> None:
    """Live lines of every bucket (``layers: all``) up to the fire, then the fire's recorded steps 3-10."""
    dump = JsonlDump(path, max_bytes=10**7, backups=0)
    for step in range(1, FIRE + 1):
        dump.write(kinds_result(step, list(range(LAYERS)) + ["embed"], moves))
    for step in RECORDED:
        dump.write({**kinds_result(step, list(range(LAYERS)) + ["embed"], moves, FIRE), "history": True})


def write_kinds_tensorboard(logdir: str, moves: Dict) -> None:
    """The live runs as the hook writes them, and the fire's runs holding every signal's norm as the recorder's
    writer names them: run ``layer-grad-norms-history/fire-000010/layer02``, tag ``layer-grad-norms-history/update``
    (``update-to-weight`` for the ratio)."""
    from torch.utils.tensorboard import SummaryWriter

    from megatron_integration.training_log import write_tensorboard

    with SummaryWriter(logdir) as writer:
        for step in range(1, FIRE + 1):
            write_tensorboard(writer, kinds_result(step, SELECTED, moves))
    entries = [logged_result(kinds_result(step, list(range(LAYERS)), moves, FIRE)) for step in RECORDED]
    for layer in range(LAYERS):
        with SummaryWriter(os.path.join(logdir, history_run_name(FIRE, layer))) as writer:
            for entry in entries:
                for signal in ALL_PHASES:
                    writer.add_scalar(scalar_tag(signal, "norm", root=HISTORY_ROOT), entry[signal][layer]["norm"],
                                      entry["step"])


@pytest.fixture(params=["dump", "tensorboard"])
def kinds_source(request, tmp_path):
    """``(source, moves, answer)`` of each scenario, written to each log."""
    def write(scenario: str):
        moves, answer = SCENARIOS[scenario]
        if request.param == "dump":
            write_kinds_dump(str(tmp_path / "dump.jsonl"), moves)
            return str(tmp_path / "dump.jsonl"), moves, answer
        write_kinds_tensorboard(str(tmp_path), moves)
        return str(tmp_path), moves, answer

    return write


def expected_departures(moves: Dict) -> Dict:
    """Per layer and signal, the first step the scenario moves it above the signal's threshold (the ratio with the
    update)."""
    moved = {**moves, **{(UPDATE_TO_WEIGHT, layer, step): factor
                         for (signal, layer, step), factor in moves.items() if signal == "update"}}
    first = {}
    for (signal, layer, step), rise in sorted(moved.items(), key=lambda move: move[0][2]):  # over a level of 1
        if rise > THRESHOLDS[signal]:
            first.setdefault(layer, {}).setdefault(signal, (step, "rose", rise))
    return first


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_report_names_the_signal_and_layer_that_left_its_median_first(kinds_source, scenario, capsys):
    source, moves, answer = kinds_source(scenario)
    main(["report", source, "--json"])
    (spike,) = json.loads(capsys.readouterr().out)["spikes"]
    attribution = spike["attribution"]
    assert attribution["signals"] == TIE_ORDER
    assert attribution["answer"] == answer
    assert spike["answer"].startswith(f"spike at step {FIRE}") and f": {answer}; " in spike["answer"]
    expected = expected_departures(moves)
    checked = 0
    for layer in range(LAYERS):
        judged = attribution["layers"][str(layer)]
        found = {signal: (move["step"], move["way"], pytest.approx(move["rise"]))
                 for signal, move in judged["departures"].items() if move}
        assert found == {signal: (step, way, pytest.approx(rise))
                         for signal, (step, way, rise) in expected.get(layer, {}).items()}
        moved = expected.get(layer, {})
        assert judged["first"] == min(moved, key=lambda signal: (moved[signal][0], TIE_ORDER.index(signal),
                                                                 -moved[signal][2]), default=None)
        checked += 1
    assert checked == LAYERS
    assert [claim["line"] for claim in verdicts(source)] == [attribution["verdict"]["line"]]
    main(["report", source])
    text = unwrapped(capsys.readouterr().out)
    assert text[-1] == spike["answer"]
    heading = ("which signal left its level first (above: gradient 2x, exp_avg 2x, exp_avg_sq 4x, update 2x, "
               "update-to-weight ratio 2x; or non-finite), per layer:")
    first = attribution["first"]
    row = text[text.index(heading) + 1]
    assert row.startswith(f"{'layer ' + str(first['layer']):>18}: {answer.split(' of ')[0]} {first['way']} at step "
                          f"{first['step']} (gradient ")


def test_the_first_long_dump_line_is_still_a_dump(tmp_path):
    """A dump line with every kind of every bucket runs past the first 4 KiB that tell a log's kind."""
    path = str(tmp_path / "dump.jsonl")
    write_kinds_dump(path, SCENARIOS["update_first"][0])
    with open(path) as dump:
        assert len(dump.readline()) > 4096
    assert [fire.fired_at for fire in read_fires(path)] == [FIRE]


def test_fires_hold_every_signal_of_every_layer(kinds_source):
    """``Fire.series[signal][layer]``: each phase of the logs, the update-to-weight ratio derived in the dump."""
    source, moves, _ = kinds_source("update_first")
    (fire,) = read_fires(source)
    assert list(fire.series) == list(ALL_PHASES)
    assert fire.norms is fire.series["pre_clip"]
    for signal in ("update", UPDATE_TO_WEIGHT):
        assert list(fire.series[signal]) == list(range(LAYERS))
    entries = {step: kinds_result(step, list(range(LAYERS)), moves) for step in RECORDED}
    ratio = [(step, pytest.approx(entries[step]["update"][2]["norm"] / entries[step]["param"][2]["norm"], rel=1e-6))
             for step in RECORDED]
    assert fire.series[UPDATE_TO_WEIGHT][2] == ratio


def moved_fire(moves: Dict, signals=TIE_ORDER, steps=RECORDED, levels: Dict = None) -> Fire:
    """A fire of ``signals`` only, each layer's at ``levels[(signal, layer, step)]`` or 1, times its move."""
    return Fire(FIRE, None, {signal: {layer: [(step, (levels or {}).get((signal, layer, step), 1.0) *
                                               moves.get((signal, layer, step), 1.0)) for step in steps]
                                      for layer in range(LAYERS)} for signal in signals})


def test_a_signal_that_starts_outside_its_bounds_has_not_left_its_median():
    """Steps recorded from step 1: every layer's second moment grows from zero (below half its median at steps 1 and 2)
    and its gradient shrinks from 5x its later size. Neither left its median; the update did, at step 9."""
    levels = {("exp_avg_sq", layer, step): float(step) for layer in range(LAYERS) for step in range(1, FIRE + 1)}
    levels.update({("pre_clip", layer, 1): 5.0 for layer in range(LAYERS)})
    spike = localise(moved_fire({("update", 3, 9): 3.0}, steps=range(1, FIRE + 1), levels=levels))
    assert spike["layers"][0]["first_risen"] == 1  # the gradient's own rise, as before
    assert spike["attribution"]["answer"] == (f"update of layer 3 rose first (step 9) {AGAINST}, no other signal "
                                              "left its level")
    assert [spike["attribution"]["layers"][layer]["first"] for layer in range(LAYERS)] == [None] * 3 + ["update"] + [
        None] * 2


def test_a_non_finite_gradient_has_left_its_median():
    spike = localise(moved_fire({("pre_clip", 3, 9): math.inf, ("exp_avg_sq", 3, FIRE): math.nan}))
    assert spike["attribution"]["answer"] == (f"gradient of layer 3 went non-finite first (step 9) {AGAINST}, "
                                              f"exp_avg_sq followed (step {FIRE})")


@pytest.mark.parametrize("signals", [["pre_clip"], ["pre_clip", "param"]])
def test_without_the_update_or_a_moment_the_spike_section_is_unchanged(signals):
    """Only the gradient (no ``optimizer_statistics``), or with the weights alone: nothing to attribute, and the
    section is as before (``test_localise_judges_each_layer_against_its_own_varying_median``)."""
    moves = {("pre_clip", 4, 8): 3.0, ("param", 2, 7): 9.0}
    spike = localise(moved_fire(moves, signals=signals))
    assert spike["attribution"] is None
    assert spike["answer"] == f"spike at step {FIRE}: layer 4 rose most, 3.0x its median at step 8"
    assert "which signal" not in format_spikes([spike])


def test_plot_history_draws_the_update_to_weight_ratio_beside_the_gradient(kinds_source, tmp_path):
    source, _, _ = kinds_source("update_first")
    fires = read_fires(source)
    figure = plot_spike_history(fires, [localise(fire) for fire in fires], str(tmp_path / "history.png"))
    norm_axis, ratio_axis, rise_axis = figure.axes[:3]
    assert ratio_axis.get_ylabel() == "|update| / |weights|"
    lines = ratio_axis.get_lines()
    assert len(lines) == LAYERS + 1  # every layer, and the fire's mark
    assert [line.get_label() for line in lines if line.get_linewidth() > 2] == ["layer 2"]  # the first to move
    thick = next(line for line in lines if line.get_linewidth() > 2)
    assert list(thick.get_xdata()) == list(RECORDED)
    assert len(norm_axis.get_lines()) == LAYERS + 1 and rise_axis.images[0].get_array().shape == (LAYERS, 8)
    assert norm_axis.get_title().splitlines()[-1] == "update of layer 2 rose first (step 8)"  # the answer's words
    assert " ".join(ratio_axis.get_title().split()).endswith("first to move: update of layer 2")  # wrapped


def test_plot_history_titles_say_every_layer_and_the_fire_continued(tmp_path):
    """The figure of two fires of a learning rate held 10x from step 60: the answer's words in each title."""
    series = adam_run("lr", 10.0, None, 100)
    fires = [fire_of(series, CAUSE_STEP + 2), fire_of(series, CAUSE_STEP + 10)]
    figure = plot_spike_history(fires, localise_all(fires), str(tmp_path / "history.png"))
    titles = [axis.get_title() for axis in figure.axes if axis.get_title().startswith("recorded steps")]
    assert titles[0].splitlines()[1].startswith(f"update of every layer (4 of 4) rose first, step {CAUSE_STEP}")
    assert " ".join(titles[1].splitlines()[1:]).endswith(f"; continues the fire at step {CAUSE_STEP + 2}")
    assert len(titles) == 2
    assert_titles_fit(figure)


def assert_titles_fit(figure) -> None:
    """Every drawn title (``plot --history``'s are long: the answer's words) inside the figure, and none over
    another: their extents as the renderer draws them."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)  # the figure is closed once saved: drawn again on a canvas of its own
    canvas.draw()
    renderer = canvas.get_renderer()
    boxes = [text.get_window_extent(renderer) for axis in figure.axes
             for text in (axis.title, axis._left_title, axis._right_title) if text.get_text()]
    inside = figure.bbox
    assert len(boxes) >= 6  # two rows of three panels
    for index, box in enumerate(boxes):
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, box
        assert not any(box.overlaps(other) for other in boxes[index + 1:]), box


# Coupled Adam dynamics (tests/adam_dynamics.py): a TinyGPT trained by torch's AdamW, each signal read from the model
# and the optimizer's state, with one known cause injected; the fires are those a log of the run would hold.
CAUSE_STEP = 60


@lru_cache(maxsize=None)
def adam_run(kind: str, factor: float, layer=None, steps: int = 1):
    return train(Cause(kind, CAUSE_STEP, factor, layer, steps), Run(steps=CAUSE_STEP + 16))


def test_a_gradient_spike_in_one_layer_names_that_layer_against_the_interval_steps():
    """Layer 1's gradient 30x at step 60 (the demo's --spike): the gradient of layer 1, alone, against the interval
    steps before the recorded steps; the moments and the update follow from it."""
    spike = localise(fire_of(adam_run("gradient", 30.0, 1), CAUSE_STEP))
    claim = spike["attribution"]["verdict"]
    assert {key: claim[key] for key in ("signal", "scope", "where", "layers", "step", "way", "before_recorded")} == {
        "signal": "pre_clip", "scope": "layer", "where": "layer 1", "layers": [1], "step": CAUSE_STEP,
        "way": "rose", "before_recorded": False}
    assert claim["baseline"] == f"against steps {CAUSE_STEP - 16}-{CAUSE_STEP - 1} just before it"  # the 16 before
    assert spike["attribution"]["answer"].startswith(f"gradient of layer 1 rose first (step {CAUSE_STEP}) against "
                                                     "steps")
    assert spike["rose_most"] == 1 and claim["continues"] is None


def test_a_learning_rate_spike_is_every_layer_s_update():
    """The learning rate 3000x at step 60 (the demo's --lr-spike), the fire at 61 where the gradient follows: the
    update of every layer, not a tie-broken one."""
    spike = localise(fire_of(adam_run("lr", 3000.0), CAUSE_STEP + 1))
    claim = spike["attribution"]["verdict"]
    assert (claim["signal"], claim["scope"], claim["count"], claim["of"], claim["step"]) == (
        "update", "every", 4, 4, CAUSE_STEP)
    assert claim["line"].startswith(f"update of every layer (4 of 4) rose first, step {CAUSE_STEP} against steps")


@pytest.mark.parametrize("before", ["interval", "recorder"])
def test_a_learning_rate_held_too_high_is_named_before_the_recorded_steps(before):
    """The learning rate 10x from step 60 on, the fire at step 74 (recorded steps 67-74): the update sat at its own
    median throughout the recorded steps, yet it is named, every layer, at the first step the data show it left its
    level: step 60 from the interval steps, the recorder block holding step 60 from the recorder's blocks."""
    series = adam_run("lr", 10.0, None, 100)
    fired_at = CAUSE_STEP + 14
    claim = localise(fire_of(series, fired_at, before=before))["attribution"]["verdict"]
    assert claim["before_recorded"] and claim["scope"] == "every" and claim["signal"] in ("update", UPDATE_TO_WEIGHT)
    if before == "interval":
        assert claim["step"] == CAUSE_STEP and claim["baseline"].startswith("against interval steps")
    else:
        first, last = claim["steps"]
        assert first <= CAUSE_STEP <= last and claim["baseline"].startswith("against its recorder blocks")
    assert "before the recorded steps" in claim["line"]
    blind = localise(fire_of(series, fired_at, before="none"))["attribution"]["verdict"]
    assert blind is None or blind["signal"] not in ("update", UPDATE_TO_WEIGHT)  # the recorded steps alone miss it


def test_a_fire_inside_a_sustained_spike_names_the_fire_it_continues():
    """The learning rate held 10x from step 60: fires at 62 and, after a cooldown of 8, at 70; the second
    continues the first."""
    series = adam_run("lr", 10.0, None, 100)
    first, second = localise_all([fire_of(series, CAUSE_STEP + 2), fire_of(series, CAUSE_STEP + 10)])
    assert first["attribution"]["verdict"]["continues"] is None
    assert second["attribution"]["verdict"]["continues"] == CAUSE_STEP + 2
    assert second["answer"].endswith(f"continues the fire at step {CAUSE_STEP + 2}") or (
        f"continues the fire at step {CAUSE_STEP + 2};" in second["answer"])
