"""``report`` and ``plot`` on every log a user has, written by a real run: a Hugging Face Trainer under ZeRO-2 on 2
CPU ranks (``report_to=["tensorboard"]``, a tiny GPT-2 built from a config) with DeepSpeed's TensorBoard and CSV
monitors and a JSONL dump rotated at every line, in one launch. Each log must give the Trainer's own logged values
(its ``log_history``), every layer at every step."""

import os
import statistics
import subprocess
import sys
from functools import lru_cache

import pytest

pytest.importorskip("transformers")

from hf_workers import EVERY_LOG_STEPS, run_with_every_log  # noqa: E402
from megatron_integration.cli import main  # noqa: E402
from megatron_integration.cpu_launch import launch  # noqa: E402
from megatron_integration.log_sources import LogSourceError  # noqa: E402
from megatron_integration.report import summarize_source  # noqa: E402
from megatron_integration.tensorboard_reader import read_layer_series  # noqa: E402

pytestmark = pytest.mark.extended  # a real Trainer launch: CI runs it in its extended pass (tests/README.md)

LAYERS = 3


@lru_cache(maxsize=None)
def hf_run(output_dir: str):
    return launch(run_with_every_log, 2, output_dir, monitors(output_dir))[0]


def monitors(output_dir: str) -> str:
    return output_dir + "-monitors"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    output_dir = str(tmp_path_factory.mktemp("hf"))
    return output_dir, hf_run(output_dir)


def logged_norms(record):
    """The Trainer's own pre-clip norms: layer -> [value per step]."""
    entries = [entry for entry in record["log_history"] if "grad_norm" in entry]
    assert [entry["step"] for entry in entries] == list(range(1, EVERY_LOG_STEPS + 1))
    return {layer: [entry[f"layer-grad-norms/pre-clip/layer{layer:02d}"] for entry in entries]
            for layer in range(LAYERS)}


def sources(output_dir):
    """Every log of the run, by name: the path a user would give."""
    (run,) = os.listdir(os.path.join(output_dir, "runs"))
    return {
        "Trainer output dir": output_dir,
        "Trainer run dir": os.path.join(output_dir, "runs", run),
        "trainer_state.json": os.path.join(output_dir, "trainer_state.json"),
        "JSONL dump, rotated": os.path.join(output_dir, "dump.jsonl"),
        "DeepSpeed TensorBoard monitor": os.path.join(monitors(output_dir), "tb"),
        "DeepSpeed CSV monitor": os.path.join(monitors(output_dir), "csv"),
    }


def test_every_log_gives_the_trainer_s_values_and_report_and_plot_run_on_it(run_dir, tmp_path):
    output_dir, record = run_dir
    expected = logged_norms(record)
    assert os.path.exists(os.path.join(output_dir, "dump.jsonl.3"))  # rotated: the reader must take every file
    checked = 0
    for name, source in sources(output_dir).items():
        series = read_layer_series(source)
        assert series.layers() == list(range(LAYERS)), name
        for layer, values in expected.items():
            assert [value for _, value in series.series("pre-clip", "norm", layer)] == pytest.approx(values,
                                                                                                  rel=1e-6), name
        summary = summarize_source(source)  # what report prints
        medians = [statistics.median(values[len(values) // 2:]) for values in expected.values()]
        assert list(summary["median_norm"].values()) == pytest.approx(medians, rel=1e-6), name
        figure = tmp_path / f"{checked}.png"
        main(["plot", source, "-o", str(figure)])
        assert figure.read_bytes()[:4] == b"\x89PNG", name
        checked += 1
    assert checked == 6


@pytest.mark.parametrize("phase", ["param", "update", "exp-avg", "exp-avg-sq", "update-to-weight"])
def test_every_log_gives_the_trainer_s_optimizer_kinds_and_ratio(run_dir, phase):
    """The callback logs each kind's norm and the update-to-weight ratio (its default phases); every log gives
    them back as phases of each layer (the dump's ratio derived from its lines' update and param)."""
    output_dir, record = run_dir
    entries = [entry for entry in record["log_history"] if "grad_norm" in entry]
    for name, source in sources(output_dir).items():
        series = read_layer_series(source)
        for layer in range(LAYERS):
            logged = [entry[f"layer-grad-norms/{phase}/layer{layer:02d}"] for entry in entries]
            assert [value for _, value in series.series(phase, "norm", layer)] == pytest.approx(logged, rel=1e-6), name
            assert all(value > 0 for value in logged)


def test_a_directory_holding_two_writers_logs_is_refused_naming_them(run_dir, tmp_path):
    """The Trainer's ``train/`` tags and DeepSpeed's monitor ``Train/Samples/`` (against samples) are not one log."""
    output_dir, _ = run_dir
    os.symlink(monitors(output_dir), tmp_path / "monitors")
    os.symlink(os.path.join(output_dir, "runs"), tmp_path / "runs")
    with pytest.raises(LogSourceError, match="more than one writer .*'Train/Samples/' and 'train/'"):
        read_layer_series(str(tmp_path))


def test_report_command_on_the_trainer_s_output_dir(run_dir):
    output_dir, record = run_dir
    report = subprocess.run([sys.executable, "-m", "megatron_integration.cli", "report", output_dir], text=True,
                            capture_output=True, timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    assert "early/late ratio: " in report.stdout


def test_an_events_file_given_directly_is_read(run_dir):
    output_dir, record = run_dir
    (run,) = os.listdir(os.path.join(output_dir, "runs"))
    folder = os.path.join(output_dir, "runs", run)
    (events,) = [name for name in os.listdir(folder) if "tfevents" in name]
    series = read_layer_series(os.path.join(folder, events))
    assert [value for _, value in series.series("pre-clip", "norm", 2)] == pytest.approx(logged_norms(record)[2])
