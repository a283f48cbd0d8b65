"""``plot`` and ``report`` on TensorBoard directories written here with known values, in every layout written so far:
one run per bucket (``log_layer_grad_norms`` now), the flat form (every bucket in one run, DeepSpeed's monitors) and
the first release's (flat, with `` vs samples`` / `` vs tokens`` copies), whose scalars the bigscience fork's writer
stores as tensors."""

import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, Hashable, Iterable, List, Tuple

import pytest
from torch.utils.tensorboard import SummaryWriter

from deepspeed_patch.outputs.jsonl_dump import JsonlDump
from deepspeed_patch.outputs.tags import LayerKey, bucket_label, flat_scalars, phase_label, scalar_tag
from megatron_integration.cli import main
from megatron_integration.plot import plot_layer_norms
from megatron_integration.tensorboard_reader import LayerSeries, NoLayerDataError, latest_per_step, read_layer_series
from megatron_integration.training_log import write_tensorboard

LAYERS = 6
STEPS = 10
LAYOUTS = ["one run per bucket", "flat", "first release", "first release, tensors"]


def known_norm(layer: int, step: int) -> float:
    """Layer 0 twice layer 5, decreasing linearly with depth: early/late ratio (2+1.8)/(1.2+1) = 1.727..."""
    return (2.0 - 0.2 * layer) * (1 + 0.01 * step)


def result(step: int, norms: Dict[Hashable, float], clip: float) -> Dict:
    """The engine's result for ``norms`` (pre-clip), clipped by ``clip``."""
    def statistics(norm: float, factor: float) -> Dict[str, float]:
        return {"norm": norm * factor, "min": -norm * factor / 8, "max": norm * factor / 8}

    return {"step": step, "pre_clip": {key: statistics(norm, 1.0) for key, norm in norms.items()},
            "post_clip": {key: statistics(norm, clip) for key, norm in norms.items()}}


def write_log(path: str, results: Iterable[Dict], layout: str) -> None:
    writer = SummaryWriter(path)
    for stats in results:
        if layout == "one run per bucket":
            write_tensorboard(writer, stats)
            continue
        for phase in ("pre_clip", "post_clip"):
            for key, values in stats[phase].items():
                for statistic, value in values.items():
                    if layout == "flat":
                        writer.add_scalar(scalar_tag(phase, statistic, key), value, stats["step"])
                    else:  # the first release's tags, literally
                        tag = f"layer-grad-norms/{phase_label(phase)}/{statistic}/{bucket_label(key)}"
                        new_style = layout == "first release, tensors"
                        writer.add_scalar(tag, value, stats["step"], new_style=new_style)
                        writer.add_scalar(tag + " vs samples", 100 * value, 4 * stats["step"], new_style=new_style)
                        writer.add_scalar(tag + " vs tokens", 100 * value, 64 * stats["step"], new_style=new_style)
    writer.add_scalar("lm loss", 1.0, 1)
    writer.close()


def known_results() -> List[Dict]:
    """Clipping at steps 3 and 7; layer 2's pre-clip norm infinite at step 5."""
    return [result(step, {layer: math.inf if (layer, step) == (2, 5) else known_norm(layer, step)
                          for layer in range(LAYERS)}, 0.5 if step in (3, 7) else 1.0)
            for step in range(1, STEPS + 1)]


@pytest.fixture(params=LAYOUTS)
def logdir(request, tmp_path):
    write_log(str(tmp_path), known_results(), request.param)
    return str(tmp_path)


def test_report_gives_the_known_ratio_and_answer(logdir, capsys):
    main(["report", logdir, "--json"])
    summary = json.loads(capsys.readouterr().out)
    expected = (known_norm(0, 8) + known_norm(1, 8)) / (known_norm(4, 8) + known_norm(5, 8))
    assert summary["early_late_ratio"] == pytest.approx(expected)
    assert summary["early_larger"] is True and summary["answer"].startswith("yes:")
    assert summary["clipped_steps"] == [3, 7]
    assert summary["overflowed"] == {"2": [5]}
    assert summary["window"] == [6, 10]


def test_report_json_is_all_that_a_piped_command_prints(tmp_path):
    """As a user pipes it, in a fresh process: DeepSpeed's import-time log lines must not reach stdout."""
    write_log(str(tmp_path), known_results(), LAYOUTS[0])
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    report = subprocess.run([sys.executable, "-m", "megatron_integration.cli", "report", str(tmp_path), "--json"],
                            capture_output=True, text=True, cwd=repo, timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    assert json.loads(report.stdout)["clipped_steps"] == [3, 7], report.stdout[:500]
    subprocess.run([sys.executable, "-m", "json.tool"], input=report.stdout, capture_output=True, text=True,
                   check=True, timeout=60)


def test_report_text(logdir, capsys):
    main(["report", logdir])
    out = capsys.readouterr().out
    assert "clipping active on 2 logged steps" in out
    assert "layer 2 at steps [5]" in out
    assert "early/late ratio: 1.73" in out


def test_plot_draws_the_normformer_layers_and_the_depth_profile(logdir, tmp_path):
    output = tmp_path / "figure.png"
    figure = plot_layer_norms(read_layer_series(logdir), str(output))
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pre_axis, post_axis, depth_axis = figure.axes[:3]
    # 0, 1, mid = 3, -2 = 4, -1 = 5 of six layers
    labels = [line.get_label() for line in pre_axis.get_lines()]
    assert labels == ["layer 0", "layer 1", "layer 3", "layer 4", "layer 5"]
    assert len(post_axis.get_lines()) == 5
    first = pre_axis.get_lines()[0]
    assert list(first.get_xdata()) == list(range(1, STEPS + 1))
    assert first.get_ydata()[0] == pytest.approx(known_norm(0, 1))
    assert depth_axis.images[0].get_array().shape == (LAYERS, STEPS)


def test_plot_writes_svg(logdir, tmp_path, capsys):
    main(["plot", logdir, "-o", str(tmp_path / "figure.svg")])
    assert (tmp_path / "figure.svg").read_text().lstrip().startswith("<?xml")


def test_directory_without_layer_data_says_what_it_found(tmp_path, capsys):
    writer = SummaryWriter(str(tmp_path))
    writer.add_scalar("lm loss", 1.0, 1)
    writer.close()
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "no per-layer gradient statistics" in err and "found: lm loss" in err
    with pytest.raises(NoLayerDataError):
        read_layer_series(str(tmp_path))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_per_parameter_logs_are_combined_into_layers(tmp_path, capsys, layout):
    """A ``granularity: param`` run logs one series per parameter; plot and report rebuild the layers."""
    parts = {"mlp.fc2.weight": 0.6, "mlp.fc2.bias": 0.8}
    norms = {f"layers.{layer}.{part}": share * (4 - layer) for layer in range(4) for part, share in parts.items()}
    write_log(str(tmp_path), [result(step, dict(norms, **{"embed.weight": 9.0}), 1.0) for step in (1, 2)], layout)
    series = read_layer_series(str(tmp_path))
    assert series.layers() == [0, 1, 2, 3]
    assert series.series("pre-clip", "norm", 0) == [(1, pytest.approx(4.0)), (2, pytest.approx(4.0))]
    assert series.series("post-clip", "max", 1) == [(1, pytest.approx(0.8 * 3 / 8)), (2, pytest.approx(0.8 * 3 / 8))]
    main(["report", str(tmp_path), "--json"])
    assert json.loads(capsys.readouterr().out)["early_late_ratio"] == pytest.approx((4 + 3) / (2 + 1))


def test_plot_and_report_read_the_jsonl_dump(tmp_path, capsys):
    path = tmp_path / "dump.jsonl"
    dump = JsonlDump(str(path), max_bytes=10**6, backups=0)
    for step in range(1, 5):
        stats = {layer: {"norm": known_norm(layer, step), "min": -1.0, "max": 1.0} for layer in range(LAYERS)}
        dump.write({"step": step, "overflow": False, "clip_coef": 1.0, "pre_clip": stats, "post_clip": stats})
    with open(path, "a") as out:
        out.write('{"step": 5, "pre_cl')  # a job killed mid-line
    main(["report", str(path), "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == [1, 4]
    assert summary["early_larger"] is True
    figure = plot_layer_norms(read_layer_series(str(path)), str(tmp_path / "figure.png"))
    assert len(figure.axes[0].get_lines()) == 5


def rolled_back_runs() -> Tuple[List[Dict], List[Dict]]:
    """Steps 1 to 10 clipped at 3 and 7, then, rolled back, steps 6 to 12 again with three times the norms,
    clipped at 8 and 11."""
    first = [result(step, {layer: known_norm(layer, step) for layer in range(LAYERS)}, 0.5 if step in (3, 7) else 1.0)
             for step in range(1, 11)]
    second = [result(step, {layer: 3 * known_norm(layer, step) for layer in range(LAYERS)},
                     0.5 if step in (8, 11) else 1.0) for step in range(6, 13)]
    return first, second


@pytest.mark.parametrize("source", ["dump"] + LAYOUTS)
def test_a_rolled_back_run_is_read_one_value_per_step_the_later_one(tmp_path, capsys, source):
    """Steps written twice (a resume or a rollback into the same dump or log directory, the demo run twice)
    count once, with the value written last, in the series, the report and the figure."""
    from deepspeed_patch.outputs.jsonl_dump import JsonlDump

    first, second = rolled_back_runs()
    path = str(tmp_path / "dump.jsonl") if source == "dump" else str(tmp_path / "tensorboard")
    for run in (first, second):
        if source == "dump":
            dump = JsonlDump(path, max_bytes=10**6, backups=0)
            for stats in run:
                dump.write(dict(stats, overflow=False))
        else:
            write_log(path, run, source)  # a new writer in the same directory, as a resumed job makes
            time.sleep(0.01)  # its events are later than the first run's
    expected = first[:5] + second  # steps 1 to 5 of the first run, 6 to 12 of the second
    series = read_layer_series(path)
    for layer in range(LAYERS):
        for phase in ("pre_clip", "post_clip"):
            assert series.series(phase_label(phase), "norm", layer) == [
                (stats["step"], pytest.approx(stats[phase][layer]["norm"])) for stats in expected]
    main(["report", path, "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == [1, 12] and summary["window"] == [7, 12]
    assert summary["clipped_steps"] == [3, 8, 11]
    assert summary["median_norm"] == {
        str(layer): pytest.approx(statistics.median(3 * known_norm(layer, step) for step in range(7, 13)))
        for layer in range(LAYERS)}
    figure = plot_layer_norms(series, str(tmp_path / "figure.png"))
    lines = figure.axes[0].get_lines()
    assert len(lines) == 5
    for line in lines:
        layer = int(line.get_label().split()[1])
        assert list(line.get_xdata()) == list(range(1, 13))
        assert list(line.get_ydata()) == pytest.approx([stats["pre_clip"][layer]["norm"] for stats in expected])
    assert figure.axes[2].images[0].get_array().shape == (LAYERS, 12)


def test_a_step_written_again_replaces_it_and_the_abandoned_run_s_later_steps():
    """Steps 1 to 4, then a resume at 3 that stops there: step 4 belongs to the abandoned run. The two runs
    need not measure the same steps."""
    assert latest_per_step([(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (3, 30.0)]) == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert latest_per_step([(1, 1.0), (3, 3.0), (5, 5.0), (2, 20.0), (4, 40.0)]) == [(1, 1.0), (2, 20.0), (4, 40.0)]


STACKS = {"encoder": 4, "decoder": 6}


def stacked_norm(stack: str, index: int, step: int) -> float:
    """The encoder's norms fall with depth, the decoder's rise: each stack has its own answer."""
    return known_norm(index, step) if stack == "encoder" else (1.0 + 0.1 * index) * (1 + 0.01 * step)


@pytest.fixture(params=LAYOUTS + ["jsonl dump"])
def stacked_source(request, tmp_path):
    """An encoder-decoder run's log (layers keyed ``"encoder.3"``), in each layout and as a JSONL dump."""
    results = [result(step, {**{LayerKey(stack, index): stacked_norm(stack, index, step)
                                for stack, layers in STACKS.items() for index in range(layers)}, "shared": 0.5}, 1.0)
               for step in range(1, STEPS + 1)]
    if request.param != "jsonl dump":
        write_log(str(tmp_path), results, request.param)
        return str(tmp_path)
    dump = JsonlDump(str(tmp_path / "dump.jsonl"), max_bytes=10**6, backups=0)
    for record in results:
        dump.write(record)
    return str(tmp_path / "dump.jsonl")


def test_report_compares_each_stack_with_itself(stacked_source, capsys):
    main(["report", stacked_source, "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert list(summary["median_norm"]) == [f"{stack}.{index}" for stack, layers in STACKS.items()
                                            for index in range(layers)]
    assert "early_late_ratio" not in summary and list(summary["stacks"]) == ["encoder", "decoder"]
    encoder, decoder = summary["stacks"]["encoder"], summary["stacks"]["decoder"]
    assert encoder["early_layers"] == ["encoder.0", "encoder.1"]
    assert encoder["late_layers"] == ["encoder.2", "encoder.3"]
    assert encoder["early_late_ratio"] == pytest.approx(
        sum(stacked_norm("encoder", i, 8) for i in (0, 1)) / sum(stacked_norm("encoder", i, 8) for i in (2, 3)))
    assert decoder["early_late_ratio"] == pytest.approx(
        sum(stacked_norm("decoder", i, 8) for i in (0, 1)) / sum(stacked_norm("decoder", i, 8) for i in (4, 5)))
    assert (encoder["early_larger"], decoder["early_larger"]) == (True, False)
    assert summary["answer"].startswith("encoder: yes: ") and "; decoder: no: " in summary["answer"]
    main(["report", stacked_source])
    out = capsys.readouterr().out
    assert "  encoder layer   3: " in out and "  decoder layer   5: " in out
    assert "early/late ratio of the stack 'decoder': 0.72" in out


def test_plot_draws_each_stack_in_a_style_and_a_band_of_its_own(stacked_source, tmp_path):
    figure = plot_layer_norms(read_layer_series(stacked_source), str(tmp_path / "figure.png"))
    pre_axis, _, depth_axis = figure.axes[:3]
    lines = [(line.get_label(), line.get_linestyle()) for line in pre_axis.get_lines()]
    assert lines == [(f"encoder layer {i}", "-") for i in (0, 1, 2, 3)] + [
        (f"decoder layer {i}", "--") for i in (0, 1, 3, 4, 5)]  # 0, 1, mid, -2, -1 of each stack
    assert depth_axis.images[0].get_array().shape == (10, STEPS)
    assert [tick.get_text() for tick in depth_axis.get_yticklabels()] == [
        f"{stack} {index}" for stack, layers in STACKS.items() for index in range(layers)]
    assert len(depth_axis.get_lines()) == 1  # the line between the stacks


KIND_FACTORS = {"param": 10.0, "update": 1e-3, "exp_avg": 0.1, "exp_avg_sq": 1e-4}
"""The optimizer kinds of ``with_kinds``: the pre-clip gradient's statistics times these."""
KIND_SOURCES = ["dump", "one run per bucket", "DeepSpeed monitor", "CSV", "trainer_state.json"]


def with_kinds(stats: Dict) -> Dict:
    """``stats`` with every ``optimizer_statistics`` kind; its update-to-weight ratio is 1e-4."""
    kinds = {kind: {key: {name: value * factor for name, value in values.items()} for key, values in
                    stats["pre_clip"].items()} for kind, factor in KIND_FACTORS.items()}
    return {**stats, "overflow": False, **kinds}


def write_source(path: str, results: List[Dict], source: str) -> str:
    """``results`` as ``source`` holds them, under ``path``; returns the path a user gives ``report``."""
    if source == "dump":
        dump = JsonlDump(os.path.join(path, "dump.jsonl"), max_bytes=10**6, backups=0)
        for stats in results:
            dump.write(stats)
        return os.path.join(path, "dump.jsonl")
    if source == "one run per bucket":
        write_log(path, results, source)
        return path
    if source == "DeepSpeed monitor":
        with SummaryWriter(path) as writer:
            for stats in results:
                for tag, value in flat_scalars(stats).items():
                    writer.add_scalar(f"Train/Samples/{tag}", value, stats["step"])
        return path
    if source == "CSV":  # a file per tag, the tag's "/" made "_"; a tag only some steps have, on those steps
        series: Dict[str, List[str]] = {}
        for stats in results:
            for tag, value in flat_scalars(stats).items():
                name = f"Train_Samples_{tag.replace('/', '_')}.csv"
                series.setdefault(name, []).append(f"{stats['step']},{value}\n")
        for name, rows in series.items():
            with open(os.path.join(path, name), "w") as out:
                out.write("step,value\n" + "".join(rows))
        return path
    with open(os.path.join(path, "trainer_state.json"), "w") as state:
        json.dump({"log_history": [{"loss": 1.0, "step": stats["step"], **flat_scalars(stats)} for stats in results]},
                  state)
    return os.path.join(path, "trainer_state.json")


@pytest.mark.parametrize("source", KIND_SOURCES)
def test_optimizer_kinds_and_the_ratio_are_read_as_phases_and_leave_the_report_as_it_was(tmp_path, capsys, source):
    plain = [result(step, {layer: known_norm(layer, step) for layer in range(LAYERS)}, 0.5 if step in (3, 7) else 1.0)
             for step in range(1, STEPS + 1)]
    series = read_layer_series(write_source(str(tmp_path), [with_kinds(stats) for stats in plain], source))
    for layer in range(LAYERS):
        for kind, factor in KIND_FACTORS.items():
            for statistic in ("norm", "min", "max"):
                assert series.series(phase_label(kind), statistic, layer) == [
                    (stats["step"], pytest.approx(stats["pre_clip"][layer][statistic] * factor)) for stats in plain]
        assert series.series("update-to-weight", "norm", layer) == [(step, pytest.approx(1e-4))
                                                                      for step in range(1, STEPS + 1)]
        assert series.series("update-to-weight", "max", layer) == []
    reports = []
    for name, results in (("kinds", [with_kinds(stats) for stats in plain]), ("plain", plain)):
        os.makedirs(tmp_path / name)
        main(["report", write_source(str(tmp_path / name), results, source), "--json"])
        reports.append(json.loads(capsys.readouterr().out))
    assert reports[0] == reports[1]


def test_per_parameter_kinds_are_combined_into_layers_and_the_ratio_derived_from_them(tmp_path):
    """The ratio does not add up over a layer's parameters: it is the layer's update norm over its weights'."""
    parts = {"mlp.fc2.weight": (3.0, 0.03), "mlp.fc2.bias": (4.0, 0.0)}  # (weights' norm, update's norm)
    results = []
    for step in (1, 2):
        stats = {f"layers.{layer}.{part}": {"norm": 1.0, "min": -0.1, "max": 0.1} for layer in range(2)
                 for part in parts}
        kinds = {kind: {key: {"norm": parts[key.split(".", 2)[2]][index] * step, "min": 0.0, "max": 1.0}
                        for key in stats} for index, kind in enumerate(("param", "update"))}
        results.append({"step": step, "pre_clip": stats, "post_clip": stats, **kinds})
    write_source(str(tmp_path), results, "DeepSpeed monitor")
    series = read_layer_series(str(tmp_path))
    assert series.layers() == [0, 1]
    assert series.series("param", "norm", 1) == [(1, pytest.approx(5.0)), (2, pytest.approx(10.0))]
    assert series.series("update-to-weight", "norm", 0) == [(1, pytest.approx(0.006)), (2, pytest.approx(0.006))]


def test_a_dump_whose_lines_outgrow_the_sniffed_head_is_read(tmp_path):
    """Every layer's statistics and the optimizer kinds make lines of many kilobytes."""
    path = str(tmp_path / "dump.jsonl")
    layers = {layer: known_norm(layer, 1) for layer in range(100)}
    JsonlDump(path, max_bytes=10**7, backups=0).write(with_kinds(result(1, layers, 1.0)))
    assert os.path.getsize(path) > 3 * 4096
    assert read_layer_series(path).series("update", "norm", 99) == [(1, pytest.approx(known_norm(99, 1) * 1e-3))]


def test_figure_colours_by_depth_one_highlight_and_legend_off_the_data(tmp_path):
    """32 layers: the depth colour map gives each its own colour; of two spiked layers drawn, one is highlighted;
    the line panels carry no legend of their own, and the figure's one legend lies below every panel."""
    from matplotlib import pyplot
    from matplotlib.colors import to_hex

    from megatron_integration.plot import HIGHLIGHT, depth_colour

    assert len({to_hex(depth_colour(position, 32)) for position in range(32)}) == 32
    with SummaryWriter(str(tmp_path / "tensorboard")) as writer:
        for step in range(1, 11):
            norms = {layer: known_norm(layer, step) for layer in range(32)}
            write_tensorboard(writer, result(step, norms, clip=1.0))
    figure = plot_layer_norms(read_layer_series(str(tmp_path / "tensorboard")), str(tmp_path / "f.png"), [5, 20])
    figure.canvas.draw()
    legend = figure.legends[0].get_window_extent()
    for axis in figure.axes[:2]:
        lines = {line.get_label(): to_hex(line.get_color()) for line in axis.get_lines()}
        assert sorted(lines) == sorted(f"layer {layer}" for layer in (0, 1, 5, 16, 20, 30, 31))
        assert [label for label, colour in lines.items() if colour == to_hex(HIGHLIGHT)] == ["layer 5"]
        assert len(set(lines.values())) == len(lines)
        assert axis.get_legend() is None and legend.y1 <= axis.get_window_extent().y0
    assert len(figure.legends) == 1
    pyplot.close(figure)


def test_a_folder_of_several_runs_is_refused_naming_them_and_run_picks_one(tmp_path, capsys):
    """Three demos' logs in one folder (a ``runs/`` folder, a Megatron TensorBoard root): ``report`` and ``plot``
    refuse in one line naming the runs (issue 44: they were merged, and the answer was nobody's); ``--run NAME``
    reports that run exactly as alone."""
    for name, factor in (("a", 1.0), ("b", 2.0), ("c/tensorboard", 3.0)):
        write_log(str(tmp_path / name), [result(step, {layer: factor * known_norm(layer, step)
                                                       for layer in range(LAYERS)}, 1.0)
                                         for step in range(1, STEPS + 1)], "one run per bucket")
    for command in (["report", str(tmp_path)], ["plot", str(tmp_path), "-o", str(tmp_path / "f.png")]):
        with pytest.raises(SystemExit) as refused:
            main(command)
        assert refused.value.code == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.endswith(f"{tmp_path}: holds 3 training runs (a, b, c/tensorboard); choose one with --run NAME "
                             "(or give its folder)")
    main(["report", str(tmp_path), "--run", "c/tensorboard", "--json"])
    picked = json.loads(capsys.readouterr().out)
    main(["report", str(tmp_path / "c" / "tensorboard"), "--json"])
    assert picked == json.loads(capsys.readouterr().out)
    assert picked["median_norm"]["0"] == pytest.approx(3 * statistics.median(known_norm(0, step)
                                                                             for step in range(6, STEPS + 1)))
    with pytest.raises(SystemExit) as missing:
        main(["report", str(tmp_path), "--run", "d"])
    assert missing.value.code == 2 and "--run d: no such run folder" in capsys.readouterr().err


def test_a_run_resumed_into_a_folder_of_its_own_is_read_as_one(tmp_path, capsys):
    """The Trainer's ``runs/<date>`` of a run resumed at step 6: it begins after the first, and continues it."""
    results = known_results()
    write_log(str(tmp_path / "first"), results[:5], "one run per bucket")
    time.sleep(0.01)
    write_log(str(tmp_path / "resumed"), results[5:], "one run per bucket")
    main(["report", str(tmp_path), "--json"])
    assert json.loads(capsys.readouterr().out)["steps"] == [1, STEPS]


@pytest.mark.parametrize("layers", [2, 3])
def test_the_early_late_verdict_needs_disjoint_layers(tmp_path, capsys, layers):
    """With 2 or 3 logged layers, early (the first two) and late (the last two) layers overlap: the report says it
    cannot compare (issue 44: "layers (0, 1) are 1.00x those of late layers (0, 1)")."""
    write_log(str(tmp_path), [result(step, {layer: known_norm(layer, step) for layer in range(layers)}, 1.0)
                              for step in range(1, STEPS + 1)], "one run per bucket")
    main(["report", str(tmp_path), "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["early_late_ratio"] is None and summary["early_layers"] is None
    assert summary["answer"].startswith(f"cannot compare: early and late layers need 4 logged layers, two of each, "
                                        f"disjoint; this run logs {layers} (layers ")
    main(["report", str(tmp_path)])
    assert "early/late ratio: -" in capsys.readouterr().out


def test_the_early_late_medians_leave_out_the_steps_around_a_fire():
    """A fire at step 8 recorded at step 8 alone: steps 8 and 9 (as many after it) are left out of the medians."""
    from megatron_integration.report import summarize

    series = LayerSeries({("pre-clip", "norm"): {layer: [(step, known_norm(layer, step) * (50 if step == 8 else 1))
                                                          for step in range(1, STEPS + 1)] for layer in range(4)}})
    summary = summarize(series, spikes=[{"steps": [8, 8], "fired_at": 8}])
    assert summary["left_out"] == [[8, 9]] and summary["window_steps"] == 3
    assert summary["median_norm"][0] == pytest.approx(known_norm(0, 7))  # the median of steps 6, 7 and 10
    assert summary["answer"].endswith("median over steps 6-10, the steps around the fire (8-9) left out")


def test_deepspeed_s_monitor_counts_samples(tmp_path, capsys):
    """DeepSpeed's monitor writes against the sample count (``Train/Samples/``): the report says samples."""
    write_source(str(tmp_path), [result(step, {layer: known_norm(layer, step) for layer in range(4)}, 1.0)
                                 for step in range(1, STEPS + 1)], "CSV")
    main(["report", str(tmp_path)])
    text = capsys.readouterr().out
    assert text.startswith("per-layer pre-clip gradient norm, median over samples 6-10 (5 logged samples):")
    assert "median over samples 6-10" in text.splitlines()[-1] and " steps" not in text


@pytest.fixture
def one_run_per_bucket(tmp_path) -> str:
    write_log(str(tmp_path / "tb"), known_results(), "one run per bucket")
    return str(tmp_path / "tb")


def test_plot_layers_draws_the_selected_layers_and_names_one_the_log_lacks(one_run_per_bucket, tmp_path, capsys):
    """``plot --layers`` as the demo's: indices as logged, ``mid`` and negative ones from the deepest layer."""
    from megatron_integration.plot import plot_run

    figure = plot_run(one_run_per_bucket, str(tmp_path / "f.png"), "0,mid,-1")
    pre_axis, _, depth_axis = figure.axes[:3]
    assert [line.get_label() for line in pre_axis.get_lines()] == ["layer 0", "layer 3", "layer 5"]
    assert depth_axis.images[0].get_array().shape == (3, STEPS)
    main(["plot", one_run_per_bucket, "--layers", "1,2", "-o", str(tmp_path / "g.png")])
    assert capsys.readouterr().out == f"figure: {tmp_path / 'g.png'}\n"
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", one_run_per_bucket, "--layers", "0,7", "-o", str(tmp_path / "h.png")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("layer-grad-norms plot: layer 7 (7) is not in this log; it holds layers "
                                       "0, 1, 2, 3, 4, 5\n")


def test_report_csv_has_one_row_per_step_and_layer(one_run_per_bucket, capsys):
    import csv

    main(["report", "--csv", one_run_per_bucket])
    header, *rows = csv.reader(capsys.readouterr().out.splitlines())
    assert header[:2] == ["step", "layer"] and "pre-clip norm" in header and "post-clip max" in header
    assert len(rows) == LAYERS * STEPS
    column, checked = header.index("pre-clip norm"), 0
    for row in rows:
        step, layer = int(row[0]), int(row[1].removeprefix("layer "))
        if (layer, step) == (2, 5):  # the overflow: written as non-finite
            assert not math.isfinite(float(row[column])), row
        else:
            assert float(row[column]) == pytest.approx(known_norm(layer, step), rel=1e-6), row
        checked += 1
    assert checked == LAYERS * STEPS


def test_a_long_read_is_announced_on_stderr_and_a_short_one_is_not(monkeypatch, capsys):
    import megatron_integration.cli as cli

    with cli.reading_notice("layer-grad-norms report: reading runs/x"):
        pass
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(cli, "NOTICE_AFTER", 0.05)
    with cli.reading_notice("layer-grad-norms report: reading runs/x"):
        time.sleep(0.5)
    assert capsys.readouterr().err == "layer-grad-norms report: reading runs/x (0 s so far)\n"


def known_loss(step: int) -> float:
    return 5.0 - 0.1 * step


def known_global_norm(step: int) -> float:
    return 3.0 * (1 + 0.01 * step)


def write_run_scalars(path: str, source: str) -> str:
    """A run's per-layer statistics (``known_results``) with its loss and global norm as ``source``'s writer names
    them (beside copies that are not them: Megatron's ``vs samples``, the Trainer's closing ``train_loss``)."""
    steps = range(1, STEPS + 1)
    if source == "trainer_state.json":
        history = [{"loss": known_loss(step), "grad_norm": known_global_norm(step), "step": step,
                    **flat_scalars(stats)} for step, stats in zip(steps, known_results())]
        with open(os.path.join(path, "trainer_state.json"), "w") as state:
            json.dump({"log_history": history + [{"train_loss": 99.0, "step": STEPS}]}, state)
        return os.path.join(path, "trainer_state.json")
    if source == "Trainer TensorBoard":  # report_to=["tensorboard"]: every number of the logs under train/
        with SummaryWriter(path) as writer:
            for step, stats in zip(steps, known_results()):
                for tag, value in {**flat_scalars(stats), "loss": known_loss(step),
                                   "grad_norm": known_global_norm(step)}.items():
                    writer.add_scalar(f"train/{tag}", value, step)
            writer.add_scalar("train/train_loss", 99.0, STEPS)
        return path
    source_path = write_source(path, known_results(), "one run per bucket" if source == "Megatron" else source)
    if source == "CSV":  # DeepSpeed's pipeline engine's loss, beside the statistics
        with open(os.path.join(path, "Train_Samples_train_loss.csv"), "w") as rows:
            rows.write("step,train_loss\n" + "".join(f"{step},{known_loss(step)}\n" for step in steps))
        return source_path
    tags = {"Megatron": ("lm loss", "grad-norm"), "DeepSpeed monitor": ("Train/Samples/train_loss", None)}[source]
    with SummaryWriter(path) as writer:
        for step in steps:
            writer.add_scalar(tags[0], known_loss(step), step)
            writer.add_scalar(f"{tags[0]} vs samples", 99.0, 4 * step)
            if tags[1]:
                writer.add_scalar(tags[1], known_global_norm(step), step)
    return source_path


def run_scalar_lines(figure) -> Dict[str, Tuple[List[int], List[float]]]:
    """The steps and values of the loss and global norm's panel, by their lines' gid, read back from the figure."""
    from megatron_integration.run_scalars import GLOBAL_NORM_GID, LOSS_GID

    return {line.get_gid(): ([int(step) for step in line.get_xdata()], [float(value) for value in line.get_ydata()])
            for axis in figure.axes for line in axis.get_lines() if line.get_gid() in (LOSS_GID, GLOBAL_NORM_GID)}


@pytest.mark.parametrize("source", ["Megatron", "trainer_state.json", "Trainer TensorBoard", "DeepSpeed monitor",
                                    "CSV"])
def test_plot_draws_the_logged_loss_and_global_norm_under_the_norms(tmp_path, source):
    from megatron_integration.plot import plot_run

    figure = plot_run(write_run_scalars(str(tmp_path), source), str(tmp_path / "f.png"))
    pre_axis, panel = figure.axes[0], figure.axes[3]
    assert panel.get_title() == "loss and global gradient norm"
    assert panel.get_shared_x_axes().joined(panel, pre_axis)
    lines = run_scalar_lines(figure)
    steps = list(range(1, STEPS + 1))
    assert lines["loss"][0] == steps and lines["loss"][1] == pytest.approx([known_loss(step) for step in steps])
    if source in ("DeepSpeed monitor", "CSV"):  # its monitor logs no global norm
        assert "global-norm" not in lines
        return
    assert lines["global-norm"][0] == steps
    assert lines["global-norm"][1] == pytest.approx([known_global_norm(step) for step in steps])
    norm_axis = next(axis for axis in figure.axes if "global-norm" in [line.get_gid() for line in axis.get_lines()])
    assert norm_axis is not panel and norm_axis.get_yscale() == "log"  # the right axis, on a log scale


@pytest.mark.parametrize("source", ["dump", "CSV"])
def test_a_log_without_the_loss_or_global_norm_draws_no_such_panel(tmp_path, source):
    from megatron_integration.plot import plot_run

    figure = plot_run(write_source(str(tmp_path), known_results(), source), str(tmp_path / "f.png"))
    assert [axis.get_title() for axis in figure.axes] == ["per-layer gradient norm, pre-clip",
                                                          "per-layer gradient norm, post-clip",
                                                          "depth profile: log10 pre-clip norm", ""]  # its colour bar
    assert run_scalar_lines(figure) == {}
