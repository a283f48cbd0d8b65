"""``plot`` and ``report`` on a TensorBoard directory written here with known values."""

import json
import math

import pytest
from torch.utils.tensorboard import SummaryWriter

from megatron_integration.cli import main
from megatron_integration.plot import plot_layer_norms
from megatron_integration.tensorboard_reader import NoLayerDataError, read_layer_series
from megatron_integration.training_log import scalar_tag

LAYERS = 6
STEPS = 10


def known_norm(layer: int, step: int) -> float:
    """Layer 0 twice layer 5, decreasing linearly with depth: early/late ratio (2+1.8)/(1.2+1) = 1.727..."""
    return (2.0 - 0.2 * layer) * (1 + 0.01 * step)


@pytest.fixture
def logdir(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    for step in range(1, STEPS + 1):
        clip = 0.5 if step in (3, 7) else 1.0
        for layer in range(LAYERS):
            pre = math.inf if (layer, step) == (2, 5) else known_norm(layer, step)
            writer.add_scalar(scalar_tag("pre_clip", "norm", layer), pre, step)
            writer.add_scalar(scalar_tag("post_clip", "norm", layer), pre * clip, step)
    writer.add_scalar("lm loss", 1.0, 1)
    writer.close()
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


def test_per_parameter_logs_are_combined_into_layers(tmp_path, capsys):
    """A ``granularity: param`` run logs one tag per parameter; plot and report rebuild the layers."""
    writer = SummaryWriter(str(tmp_path))
    for step in (1, 2):
        for layer in range(4):
            for part, share in (("mlp.fc2.weight", 0.6), ("mlp.fc2.bias", 0.8)):
                writer.add_scalar(scalar_tag("pre_clip", "norm", f"layers.{layer}.{part}"), share * (4 - layer), step)
                writer.add_scalar(scalar_tag("post_clip", "norm", f"layers.{layer}.{part}"), share * (4 - layer), step)
    writer.close()
    series = read_layer_series(str(tmp_path))
    assert series.layers() == [0, 1, 2, 3]
    assert series.series("pre-clip", "norm", 0) == [(1, pytest.approx(4.0)), (2, pytest.approx(4.0))]
    main(["report", str(tmp_path), "--json"])
    assert json.loads(capsys.readouterr().out)["early_late_ratio"] == pytest.approx((4 + 3) / (2 + 1))


def test_layout_has_a_chart_per_parameter_family():
    import re

    from megatron_integration.training_log import custom_scalars_layout

    layout = custom_scalars_layout(["layers.0.mlp.fc2.weight", "layers.1.mlp.fc2.weight", "embed.weight",
                                    "0.dense_4h_to_h"])
    assert set(layout) == {"layer-grad-norms pre-clip", "layer-grad-norms post-clip",
                           "layer-grad-norms pre-clip: mlp.fc2.weight", "layer-grad-norms post-clip: mlp.fc2.weight",
                           "layer-grad-norms pre-clip: dense_4h_to_h", "layer-grad-norms post-clip: dense_4h_to_h"}
    pattern = layout["layer-grad-norms pre-clip: mlp.fc2.weight"]["norm"][1][0]
    assert re.match(pattern, scalar_tag("pre_clip", "norm", "layers.7.mlp.fc2.weight"))
    assert not re.match(pattern, scalar_tag("pre_clip", "norm", "layers.7.mlp.fc1.weight"))


def test_plot_and_report_read_the_jsonl_dump(tmp_path, capsys):
    from deepspeed_patch.on_demand import JsonlDump

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
