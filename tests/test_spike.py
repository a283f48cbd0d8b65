"""Where a fire's recorded steps go and what ``report`` and ``plot --history`` make of them, on results built here
with known values: the hook's TensorBoard runs per fire, the JSONL dump's ``"history": true`` lines."""

import json
import os
from typing import Dict, List

import pytest

from deepspeed_patch.on_demand import JsonlDump
from deepspeed_patch.tags import history_run_name, run_name
from megatron_integration.arguments import add_layer_grad_norms_args
from megatron_integration.cli import main
from megatron_integration.plot import plot_spike_history
from megatron_integration.spike import localise, read_fires
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
    assert text.splitlines()[-1] == spike["answer"]
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
