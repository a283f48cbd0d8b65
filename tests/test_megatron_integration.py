"""The Megatron side: flags, the ds_config they fill, and the training-log hook into TensorBoard."""

import argparse
import contextlib
import importlib.util
import json
import logging
import math
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from deepspeed_patch.config import load_config
from deepspeed_patch.outputs.tags import OPTIMIZER_KINDS, LayerKey
from megatron_integration import layer_grad_norms_ds_config
from megatron_integration.cpu_launch import launch
from megatron_integration.tensorboard_layout import custom_scalars_layout, placements
from megatron_integration.tensorboard_reader import read_layer_series
from megatron_integration.training_log import log_layer_grad_norms, log_string_field
from megatron_workers import megatron_args, train_with_training_log

STEPS = 6
FLAGS = ["--log-layer-grad-norms", "--tensorboard-log-interval", "2", "--log-interval", "4"]


def test_flag_defaults():
    args = megatron_args([])
    assert (args.log_layer_grad_norms, args.layer_grad_norms_layers, args.layer_grad_norms_interval) == (
        False, "0,1,mid,-2,-1", None)
    assert layer_grad_norms_ds_config(args, {"a": 1}) == {"a": 1}  # off: unchanged


def test_flags_fill_the_block_with_the_tensorboard_interval():
    config = layer_grad_norms_ds_config(megatron_args(FLAGS), {"zero_optimization": {"stage": 1}})
    assert config["layer_grad_norms"] == {"enabled": True, "layers": "0,1,mid,-2,-1", "interval": 2}
    assert config["zero_optimization"] == {"stage": 1}


def test_flags_fill_a_config_read_from_its_path(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    args = megatron_args(FLAGS + ["--layer-grad-norms-interval", "5", "--layer-grad-norms-layers", "all"])
    args.deepspeed_config = str(path)
    config = layer_grad_norms_ds_config(args)
    assert config == {"train_micro_batch_size_per_gpu": 2,
                      "layer_grad_norms": {"enabled": True, "layers": "all", "interval": 5}}


def test_block_in_the_ds_config_wins_with_a_warning(caplog):
    block = {"enabled": True, "layers": "all", "interval": 1}
    with caplog.at_level(logging.WARNING):
        config = layer_grad_norms_ds_config(megatron_args(FLAGS), {"layer_grad_norms": block})
    assert config["layer_grad_norms"] == block
    assert "wins over the command-line flags" in caplog.text


def test_optimizer_statistics_flag_fills_the_block_s_kinds():
    args = megatron_args(FLAGS + ["--layer-grad-norms-optimizer-statistics", "update,param, exp_avg_sq"])
    block = layer_grad_norms_ds_config(args, {})["layer_grad_norms"]
    assert block["optimizer_statistics"] == ["update", "param", "exp_avg_sq"]
    assert load_config({"layer_grad_norms": block}).optimizer_statistics == ("param", "update", "exp_avg_sq")
    assert "optimizer_statistics" not in layer_grad_norms_ds_config(megatron_args(FLAGS), {})["layer_grad_norms"]


FAKE_FORK_FLAGS = [f"--{flag}=2" for flag in (
    "num-layers", "hidden-size", "num-attention-heads", "seq-length", "micro-batch-size", "global-batch-size",
    "train-iters", "vocab-size", "log-interval", "tensorboard-log-interval", "tensor-model-parallel-size",
    "pipeline-model-parallel-size", "zero-stage", "seed")] + ["--data-path=d", "--tensorboard-dir=t",
                                                               "--deepspeed_config=c.json", "--log-layer-grad-norms"]


def fake_fork_parse_args(flags: List[str], monkeypatch) -> argparse.Namespace:
    """The fake fork's ``megatron.arguments.parse_args`` (tests/fake_fork), loaded under a name of its own, on a
    command line of its required flags and ``flags``."""
    spec = importlib.util.spec_from_file_location("fake_fork_arguments",
                                                  Path(__file__).parent / "fake_fork" / "megatron" / "arguments.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *FAKE_FORK_FLAGS, *flags])
    return module.parse_args()


BAD_FLAGS = [
    (["--layer-grad-norms-layers", "0,last"], "'0,last': 'last' is not a layer index or 'mid'; expected \"all\""),
    (["--layer-grad-norms-interval", "0"], "'0' is not a positive integer"),
    (["--layer-grad-norms-trigger", "0.5"], "'0.5': must be more than 1 (a multiple of the median)"),
    (["--layer-grad-norms-trigger", "often"], "'often' is not a number"),
    (["--layer-grad-norms-history", "-1"], "'-1': expected 0 (off) or a positive integer"),
    (["--layer-grad-norms-optimizer-statistics", "param,momentum"],
     "'param,momentum': 'momentum' is not a kind; choose from param, update, exp_avg, exp_avg_sq"),
    (["--layer-grad-norms-optimizer-statistics", ""], "'': '' is not a kind"),
    (["--layer-grad-norms-skip-step", "sigma=-1"], "'sigma=-1': Input should be greater than 0"),
    (["--layer-grad-norms-skip-step", "sgma=1"], "'sgma=1': 'sgma=1' is not one of sigma=..., window=..."),
    (["--layer-grad-norms-adaptive-clipping", "beta=1.5"], "'beta=1.5': Input should be less than 1"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS)
def test_bad_flags_are_refused_by_the_fork_s_parser_naming_the_flag(flags, message, monkeypatch, capsys):
    """At argument parsing, before any model is built: argparse's one line, in the flag's own name, exit code 2."""
    with pytest.raises(SystemExit) as exit_info:
        fake_fork_parse_args(flags, monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2, err
    assert err[-1].startswith(f"pretrain_gpt.py: error: argument {flags[0]}: {message}"), err


def test_good_flags_pass_the_fork_s_parser_into_the_block(monkeypatch):
    args = fake_fork_parse_args(["--layer-grad-norms-trigger", "4", "--layer-grad-norms-skip-step", "sigma=5"],
                                monkeypatch)
    block = layer_grad_norms_ds_config(args, {})["layer_grad_norms"]
    assert block["trigger"] == {"grad_norm_factor": 4.0, "loss_factor": 4.0}
    assert block["skip_step"] == {"enabled": True, "sigma": 5}


def test_a_namespace_built_by_hand_is_checked_by_the_same_rules():
    """A fork that fills the namespace itself, not through ``add_layer_grad_norms_args``: the same message, named
    after the flag, at ``layer_grad_norms_ds_config``."""
    args = argparse.Namespace(log_layer_grad_norms=True, layer_grad_norms_layers="0,last", layer_grad_norms_interval=1)
    with pytest.raises(ValueError, match="^--layer-grad-norms-layers: '0,last': 'last' is not a layer index"):
        layer_grad_norms_ds_config(args, {})


def test_log_string_field_format():
    stats = {"pre_clip": {0: {"norm": 0.25}, 11: {"norm": 1.5}, "embed": {"norm": 3.0}}}
    assert log_string_field(stats) == " layer grad norm: 0: 2.500E-01 | 11: 1.500E+00 |"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """2 pipeline stages on 2 ranks, 6 iterations, TensorBoard every 2, log line every 4."""
    tensorboard_dir = str(tmp_path_factory.mktemp("tensorboard"))
    return tensorboard_dir, launch(train_with_training_log, 2, tensorboard_dir, FLAGS, STEPS)


def scalars(tensorboard_dir: str) -> Dict[Tuple[str, str], Dict[int, float]]:
    """``{(run, tag): {step: value}}`` of every scalar under ``tensorboard_dir``."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    multiplexer = EventMultiplexer(size_guidance={"scalars": 0, "tensors": 0})
    multiplexer.AddRunsFromDirectory(tensorboard_dir)
    multiplexer.Reload()
    return {(run, tag): {event.step: event.value for event in multiplexer.Scalars(run, tag)}
            for run, tags in multiplexer.Runs().items() for tag in tags["scalars"]}


def test_tensorboard_holds_every_logged_layer_statistic_one_run_per_bucket(run):
    tensorboard_dir, records = run
    logged_scalars = scalars(tensorboard_dir)
    last = records[-1]
    logged = {i + 1: m for i, m in enumerate(last["measured"]) if (i + 1) % 2 == 0}
    assert sorted(logged) == [2, 4, 6]
    places = placements(logged[2]["pre_clip"])
    assert sorted(place.run for place in places.values() if place.layer is not None) == [
        f"layer-grad-norms/layer{layer:02d}" for layer in (0, 1, 3, 4, 5)]  # 6 layers
    outside = {place.run for place in places.values() if place.layer is None}
    assert outside and all(place.root == "non-layer-grad-norms" for place in places.values() if place.layer is None)
    for iteration, measured in logged.items():
        assert measured["step"] == iteration
        assert sorted(k for k in measured["pre_clip"] if isinstance(k, int)) == [0, 1, 3, 4, 5]
        assert set(measured["post_clip"]) == set(measured["pre_clip"]) == set(places)
        for phase in ("pre_clip", "post_clip"):
            for key, values in measured[phase].items():
                for statistic in ("norm", "min", "max"):
                    series = logged_scalars[places[key].run, places[key].tag(phase, statistic)]
                    assert series[iteration] == pytest.approx(values[statistic], rel=1e-6)
    assert sorted(logged_scalars["layer-grad-norms/layer00", "layer-grad-norms/pre-clip"]) == [2, 4, 6]
    runs = {run for run, _ in logged_scalars}
    assert runs == {place.run for place in places.values()}  # nothing in the Megatron writer's own run
    tags = {tag for _, tag in logged_scalars}
    assert len(tags) == 12 and not any(" vs " in tag for tag in tags)  # one per phase and statistic, twice


def written_layout(tensorboard_dir: str) -> Dict[str, Dict[str, list]]:
    """The Custom Scalars layout written into the writer's own run: ``{category: {chart: [tag regex]}}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    events = EventAccumulator(tensorboard_dir, size_guidance={"tensors": 0})
    events.Reload()
    written = layout_pb2.Layout.FromString(events.Tensors(metadata.CONFIG_SUMMARY_TAG)[0].tensor_proto.string_val[0])
    return {category.title: {chart.title: list(chart.multiline.tag) for chart in category.chart}
            for category in written.category}


def test_tensorboard_has_the_custom_scalars_layout(run):
    tensorboard_dir, _ = run
    layout = written_layout(tensorboard_dir)
    assert set(layout) == {"layer-grad-norms pre-clip", "layer-grad-norms post-clip", "non-layer-grad-norms pre-clip",
                           "non-layer-grad-norms post-clip"}
    logged_tags = {(run, tag) for run, tag in scalars(tensorboard_dir)}
    matched = {run for run, tag in logged_tags if re.match(layout["layer-grad-norms pre-clip"]["norm"][0], tag)}
    assert matched == {f"layer-grad-norms/layer{layer:02d}" for layer in (0, 1, 3, 4, 5)}


def test_log_line_on_log_interval_iterations_only_and_no_collective(run):
    _, records = run
    assert [record["collectives_in_log_call"] for record in records] == [0, 0]
    fields = records[-1]["log_fields"]
    assert [bool(field) for field in fields] == [False, False, False, True, False, False]
    assert fields[3].startswith(" layer grad norm: 0: ")
    assert records[0]["log_fields"] == records[-1]["log_fields"]  # every rank can build the line


def test_args_are_an_extra_args_provider():
    from megatron_integration import add_layer_grad_norms_args

    parser = argparse.ArgumentParser()
    assert add_layer_grad_norms_args(parser) is parser


@pytest.mark.parametrize("fork", ["bigscience", "microsoft"])
def test_fork_patches_call_only_what_the_package_exports(fork):
    """The patches cannot be applied here (no fork checkout, no network); their calls into this package can be
    checked: every name they import exists, and each patches the arguments, the ds_config and training_log."""
    import re
    from pathlib import Path

    import megatron_integration

    patch = (Path(megatron_integration.__file__).parent / "patches" / f"{fork}.patch").read_text()
    imported = re.findall(r"^\+from megatron_integration import (.+)$", patch, flags=re.MULTILINE)
    names = {name.strip() for line in imported for name in line.split(",")}
    assert names == {"add_layer_grad_norms_args", "layer_grad_norms_ds_config", "log_layer_grad_norms"}
    assert names <= set(megatron_integration.__all__)
    for call in ("add_layer_grad_norms_args(parser)", "layer_grad_norms_ds_config(args,", "log_layer_grad_norms("):
        assert call in patch
    assert "+            loss=loss_dict.get('lm loss'))" in patch  # the reduced loss, for the trigger's loss_factor
    assert {"a/megatron/arguments.py", "a/megatron/training.py"} == set(re.findall(r"^--- (\S+)$", patch, re.M))


class LastMeasurement:
    """The engine's side of the hook's contract: ``get_layer_grad_norms()`` is the last measured step's result."""

    def __init__(self) -> None:
        self.stats = None
        self.history = None

    def get_layer_grad_norms(self):
        return self.stats

    def get_layer_grad_norms_history(self):
        return self.history


KIND_FACTORS = {"param": 40.0, "update": 0.02, "exp_avg": 0.3, "exp_avg_sq": 0.004}
"""The ``optimizer_statistics`` kinds of ``measurement``: the gradient's statistics times these."""


def measurement(step: int, keys, overflowed=None, kinds=()):
    """A result as the engine reports it; ``overflowed``: the bucket whose pre-clip statistics are infinite (the
    step is then an fp16 overflow, without post-clip statistics); ``kinds``: the optimizer statistics it holds."""

    def statistics(key, factor: float):
        norm = math.inf if key == overflowed else (3.0 - key if isinstance(key, int) else 0.5) * (1 + step / 1000)
        return {"norm": norm * factor, "min": -norm * factor / 10, "max": norm * factor / 10, "abs_min": 0.0,
                "abs_max": norm * factor / 10, "nonfinite": int(key == overflowed)}

    pre_clip = {key: statistics(key, 1.0) for key in keys}
    optimizer = {kind: {key: statistics(key, KIND_FACTORS[kind]) for key in keys} for kind in kinds}
    if overflowed is not None:
        return {"step": step, "overflow": True, "clip_coef": None, "pre_clip": pre_clip, "post_clip": None,
                **optimizer}
    return {"step": step, "overflow": False, "clip_coef": 0.5, "pre_clip": pre_clip,
            "post_clip": {key: statistics(key, 0.5) for key in keys}, **optimizer}


def event_files(logdir) -> int:
    return sum(name.startswith("events.out.tfevents") for _, _, names in os.walk(logdir) for name in names)


def open_files_under(folder) -> int:
    """How many of this process's file descriptors are open on files under ``folder``: only what the test's
    writers hold is counted (the whole process's count moves with other threads: pytest's, torch's)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # an fd closed since the listing, the listing's own
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(f"{folder}{os.sep}")
    return count


def test_bucket_runs_share_one_writer_thread_flushed_and_closed_with_the_megatron_writer(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    args, engine, keys = megatron_args(["--log-layer-grad-norms"]), LastMeasurement(), [0, 1, 2, "embed"]
    threads_before = threading.active_count()
    writer = SummaryWriter(str(tmp_path))  # as Megatron's: the last rank's, never closed by the training loop

    def iterate(iteration: int) -> None:
        engine.stats = measurement(iteration, keys)
        log_layer_grad_norms(engine, iteration, writer, args)

    iterate(1)
    writer.flush()  # the parent's flush flushes the bucket runs
    held = (threading.active_count(), open_files_under(tmp_path), event_files(tmp_path))
    assert held[0] == threads_before + 2  # Megatron's writer's thread, and one for every bucket's run
    assert held[2] == 1 + len(keys)
    assert read_layer_series(str(tmp_path)).series("pre-clip", "norm", 2) == [(1, pytest.approx(1.001))]
    for iteration in range(2, 401):
        iterate(iteration)
    writer.flush()  # no write under way while counting: without TF, each write opens the events file for its append
    assert held[1] <= 1 + len(keys)  # at most each run's events file (tensorboard's GFile without TF holds none)
    assert (threading.active_count(), open_files_under(tmp_path), event_files(tmp_path)) == held
    writer.close()
    assert threading.active_count() == threads_before
    series = read_layer_series(str(tmp_path))
    assert [step for step, _ in series.series("post-clip", "norm", 2)] == list(range(1, 401))
    iterate(401)  # a writer used after close starts its bucket runs afresh
    writer.close()
    assert threading.active_count() == threads_before
    assert read_layer_series(str(tmp_path)).series("pre-clip", "max", 0)[-1] == (401, pytest.approx(0.3 * 1.401))


def test_the_runs_reach_the_disk_when_the_process_ends_without_closing_the_writer(tmp_path):
    """Megatron never closes its writer: what the hook queued is written at the process's exit."""
    script = "\n".join([
        "from torch.utils.tensorboard import SummaryWriter",
        "from megatron_integration.training_log import write_tensorboard",
        "from test_megatron_integration import measurement",
        f"writer = SummaryWriter({str(tmp_path)!r})",
        "for step in range(1, 201):",
        "    write_tensorboard(writer, measurement(step, [0, 1, 'embed']))",
    ])
    path = os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-c", script], check=True, env={**os.environ, "PYTHONPATH": path}, timeout=300)
    logged = scalars(str(tmp_path))
    assert sorted(logged["layer-grad-norms/layer01", "layer-grad-norms/post-clip"]) == list(range(1, 201))
    assert logged["layer-grad-norms/embed", "non-layer-grad-norms/pre-clip"][200] == pytest.approx(0.5 * 1.2)


LAYERS_24 = list(range(24)) + ["embed"]
FIRES = (6, 12)
RECORDED = 4  # the steps a fire's history holds


def train_24_layers(writer, engine, iterations: int = 14) -> Dict[int, str]:
    """The hook on a 24-layer model (and an embedding) with every optimizer kind, Megatron's own loss beside it,
    and a fire at each of ``FIRES`` with its recorded steps; the log fields by iteration."""
    args = megatron_args(["--log-layer-grad-norms"])
    fields = {}
    for iteration in range(1, iterations + 1):
        engine.stats = measurement(iteration, LAYERS_24, kinds=OPTIMIZER_KINDS)
        if iteration in FIRES:
            engine.history = [{**measurement(step, LAYERS_24, kinds=OPTIMIZER_KINDS),
                               "trigger": {"fired_at": iteration}}
                              for step in range(iteration - RECORDED + 1, iteration + 1)]
        writer.add_scalar("lm loss", 1.0 / iteration, iteration)
        fields[iteration] = log_layer_grad_norms(engine, iteration, writer, args)
    return fields


def test_a_24_layer_model_with_fires_keeps_its_writer_threads_bounded_and_one_run_per_layer(tmp_path):
    """One thread for the live runs and one for the fires' runs, whatever the buckets and fires (a SummaryWriter per
    run held 1 + 25 + 25 here); TensorBoard reads one run per layer, live and per fire, with the logged values."""
    from torch.utils.tensorboard import SummaryWriter

    before = set(threading.enumerate())
    writer, engine = SummaryWriter(str(tmp_path)), LastMeasurement()
    train_24_layers(writer, engine)
    added = set(threading.enumerate()) - before
    assert len(added) == 3, added  # Megatron's writer's, the live runs', the history runs'
    writer.close()
    assert set(threading.enumerate()) == before
    logged = scalars(str(tmp_path))
    live = {f"layer-grad-norms/layer{layer:02d}" for layer in range(24)} | {"layer-grad-norms/embed"}
    fires = {f"layer-grad-norms-history/fire-{fire:06d}/{run.rpartition('/')[2]}" for fire in FIRES for run in live}
    assert {run for run, _ in logged} == live | fires | {"."}  # "." is Megatron's own run, its loss
    checked = 0
    for layer in LAYERS_24:
        run = "layer-grad-norms/" + (f"layer{layer:02d}" if isinstance(layer, int) else layer)
        root = "layer-grad-norms" if isinstance(layer, int) else "non-layer-grad-norms"
        assert logged[run, f"{root}/pre-clip"] == pytest.approx(
            {step: measurement(step, [layer])["pre_clip"][layer]["norm"] for step in range(1, 15)})
        assert logged[run, f"{root}/values/max/update"][7] == pytest.approx(
            measurement(7, [layer], kinds=["update"])["update"][layer]["max"])
        for fire in FIRES:
            history = logged[run.replace("layer-grad-norms/", f"layer-grad-norms-history/fire-{fire:06d}/"),
                             f"{root}-history/pre-clip"]
            assert history == pytest.approx({step: measurement(step, [layer])["pre_clip"][layer]["norm"]
                                             for step in range(fire - RECORDED + 1, fire + 1)})
            checked += 1
    assert checked == 2 * 25


def record_writer_raising_under(directory: str):
    """TensorBoard's record writer, raising for the files under ``directory`` of the log directory (a failure in
    the writer thread, surfacing in the training thread's next call)."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    original = RecordWriter.write

    def write(self, data):
        if f"/{directory}/".encode() in self._writer.filename:
            raise OSError(f"injected failure under {directory}")
        return original(self, data)

    return write


@contextlib.contextmanager
def full_disk(path):
    """``path``, a tmpfs of 24 KiB (as root): full after a few of the 24-layer model's scalars."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to mount a small tmpfs")
    os.makedirs(path)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24k", "tmpfs", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def failures(caplog):
    return [record.getMessage() for record in caplog.records if record.exc_info]


READERS = {"layer-grad-norms": "the Megatron hook's TensorBoard runs",
           "layer-grad-norms-history": "the Megatron hook's history runs"}


@pytest.mark.parametrize("fault", ["raising writer", "full disk"])
@pytest.mark.parametrize("directory", list(READERS))
def test_a_failing_reader_of_the_hook_stops_alone_logged_once(tmp_path, caplog, monkeypatch, directory, fault):
    """The live runs' or the fires' runs failing (a writer raising, a full disk under their directory): one
    traceback naming that reader; the other reader, Megatron's own run and the log line go on; nothing raises, and
    the reader's thread is gone."""
    from tensorboard.summary.writer.record_writer import RecordWriter
    from torch.utils.tensorboard import SummaryWriter

    if fault == "raising writer":
        monkeypatch.setattr(RecordWriter, "write", record_writer_raising_under(directory))
    before = set(threading.enumerate())
    with full_disk(tmp_path / directory) if fault == "full disk" else contextlib.nullcontext():
        writer, engine = SummaryWriter(str(tmp_path)), LastMeasurement()
        with caplog.at_level(logging.ERROR):
            fields = train_24_layers(writer, engine)
            writer.close()
        logged = scalars(str(tmp_path))
    (message, ) = failures(caplog)  # at the reader's call after its thread failed, with the step if a write's
    assert re.fullmatch(f"layer_grad_norms: {READERS[directory]} failed( at step \\d+)? on rank 0; it is switched "
                        "off on this rank, training, the statistics and the other readers go on",
                        message), message
    assert set(threading.enumerate()) == before
    assert [iteration for iteration, field in fields.items() if field] == list(range(1, 15))
    assert sorted(logged[".", "lm loss"]) == list(range(1, 15))  # Megatron's own run
    other = "layer-grad-norms-history/fire-000012/layer23" if directory == "layer-grad-norms" else \
        "layer-grad-norms/layer23"
    root = "layer-grad-norms-history" if directory == "layer-grad-norms" else "layer-grad-norms"
    assert sorted(logged[other, f"{root}/pre-clip"]) == (list(range(9, 13)) if "history" in other else
                                                        list(range(1, 15)))


def test_an_overflowed_bucket_is_drawn_as_nan_and_reported(tmp_path):
    """TensorBoard marks a NaN point and draws on; an infinite one would break the line."""
    from torch.utils.tensorboard import SummaryWriter

    from megatron_integration.report import summarize

    args, engine, keys = megatron_args(["--log-layer-grad-norms"]), LastMeasurement(), [0, 1, 2, 3]
    with SummaryWriter(str(tmp_path)) as writer:
        for iteration in range(1, 7):
            engine.stats = measurement(iteration, keys, overflowed=1 if iteration == 4 else None)
            log_layer_grad_norms(engine, iteration, writer, args)
    series = read_layer_series(str(tmp_path))
    assert [step for step, _ in series.series("pre-clip", "norm", 1)] == [1, 2, 3, 4, 5, 6]
    assert [step for step, value in series.series("pre-clip", "norm", 1) if math.isnan(value)] == [4]
    assert all(math.isfinite(value) for step, value in series.series("pre-clip", "norm", 1) if step != 4)
    assert [step for step, _ in series.series("post-clip", "norm", 1)] == [1, 2, 3, 5, 6]
    assert summarize(series)["overflowed"] == {1: [4]}


def test_every_step_the_engine_measured_is_logged_once_at_its_own_step(tmp_path):
    """Not only the hook's interval (2 here): steps a trigger captured or a ds_config block measured on an interval
    of its own reach TensorBoard too, each once, however often the hook reads the same result."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    from torch.utils.tensorboard import SummaryWriter

    args, engine, keys = megatron_args(FLAGS), LastMeasurement(), [0, 1, "embed"]
    measured = {3: "a trigger's capture", 4: "the interval", 5: "not read at its own iteration", 7: "another interval"}
    fields = {}
    with SummaryWriter(str(tmp_path)) as writer:
        for iteration in range(1, 10):
            if iteration in measured:
                engine.stats = measurement(iteration, keys)
            if iteration != 5:  # its result is read at iteration 6, and logged at step 5
                fields[iteration] = log_layer_grad_norms(engine, iteration, writer, args)
    multiplexer = EventMultiplexer(size_guidance={"scalars": 0})
    multiplexer.AddRunsFromDirectory(str(tmp_path))
    multiplexer.Reload()
    events = multiplexer.Scalars("layer-grad-norms/layer01", "layer-grad-norms/post-clip")
    assert [event.step for event in events] == sorted(measured)  # each once, in step order
    assert [event.value for event in events] == pytest.approx(
        [measurement(step, keys)["post_clip"][1]["norm"] for step in sorted(measured)])
    assert [iteration for iteration, field in fields.items() if field] == [4]  # the --log-interval, when measured


def test_layout_has_a_chart_per_part_of_a_layer_and_for_the_buckets_outside():
    keys = ["layers.0.mlp.fc2.weight", "layers.1.mlp.fc2.weight", "embed.weight", "0.dense_4h_to_h", "2"]
    layout = custom_scalars_layout(keys)
    assert set(layout) == {f"{root} {phase}{part}" for phase in ("pre-clip", "post-clip") for root, part in [
        ("layer-grad-norms", ""), ("layer-grad-norms", ": mlp.fc2.weight"), ("layer-grad-norms", ": dense_4h_to_h"),
        ("non-layer-grad-norms", "")]}
    places = placements(keys + ["layers.7.mlp.fc1.weight"])
    assert places["2"].run == "layer-grad-norms/layer02"
    assert places["2"].tag("pre_clip", "norm") == "layer-grad-norms/pre-clip"
    assert places["embed.weight"].run == "layer-grad-norms/embed.weight"
    pattern = layout["layer-grad-norms pre-clip: mlp.fc2.weight"]["max"][1][0]
    assert re.match(pattern, places["layers.1.mlp.fc2.weight"].tag("pre_clip", "max"))
    assert not re.match(pattern, places["layers.7.mlp.fc1.weight"].tag("pre_clip", "max"))
    assert places["layers.7.mlp.fc1.weight"].run == "layer-grad-norms/layer07"
    outside = layout["non-layer-grad-norms post-clip"]["norm"][1][0]
    assert re.match(outside, places["embed.weight"].tag("post_clip", "norm"))


def test_layers_of_several_stacks_are_named_by_their_stack():
    """An encoder-decoder model's layers (``LayerKey``): the log line, the runs and the layout name the stack."""
    keys = [LayerKey("encoder", 0), LayerKey("encoder", 1), LayerKey("decoder", 0), "shared", "head.0"]
    stats = {"pre_clip": {key: {"norm": 0.25 * (index + 1)} for index, key in enumerate(keys)}}
    assert log_string_field(stats) == (" layer grad norm: encoder.0: 2.500E-01 | encoder.1: 5.000E-01 | "
                                       "decoder.0: 7.500E-01 |")
    places = placements(keys)
    assert [places[key].run for key in keys] == [
        "layer-grad-norms/encoder.layer00", "layer-grad-norms/encoder.layer01", "layer-grad-norms/decoder.layer00",
        "layer-grad-norms/shared", "layer-grad-norms/head.0"]
    assert [places[key].root for key in keys] == ["layer-grad-norms"] * 3 + ["non-layer-grad-norms"] * 2
    assert places[keys[2]].tag("pre_clip", "norm") == "layer-grad-norms/pre-clip"
    chart = custom_scalars_layout(keys)["layer-grad-norms pre-clip"]["norm"][1][0]
    assert re.match(chart, places[keys[2]].tag("pre_clip", "norm"))


def test_parts_of_a_layer_with_the_same_name_keep_their_whole_names():
    """An encoder's and a decoder's layer 0 (``granularity: param``): one tag each, never one for both."""
    places = placements(["encoder.layers.0.mlp.weight", "decoder.layers.0.mlp.weight", "encoder.layers.1.mlp.weight",
                         "encoder.layers.1.attn.weight"])
    tags = {key: (place.run, place.tag("pre_clip", "norm")) for key, place in places.items()}
    whole = "layer-grad-norms/pre-clip/{}".format
    assert tags == {
        "encoder.layers.0.mlp.weight": ("layer-grad-norms/layer00", whole("encoder.layers.0.mlp.weight")),
        "decoder.layers.0.mlp.weight": ("layer-grad-norms/layer00", whole("decoder.layers.0.mlp.weight")),
        "encoder.layers.1.mlp.weight": ("layer-grad-norms/layer01", whole("encoder.layers.1.mlp.weight")),
        "encoder.layers.1.attn.weight": ("layer-grad-norms/layer01", whole("attn.weight")),
    }


def test_optimizer_kinds_and_the_ratio_are_written_as_pre_clip_is_live_and_in_history_runs(tmp_path):
    """Each kind and the update-to-weight ratio: a tag of its own in each bucket's run, a Custom Scalars category,
    the fire's runs; read back as phases (the ratio has its norm only)."""
    from torch.utils.tensorboard import SummaryWriter

    args, engine, keys = megatron_args(["--log-layer-grad-norms"]), LastMeasurement(), [0, 1, "embed"]
    with SummaryWriter(str(tmp_path)) as writer:
        for iteration in range(1, 5):
            engine.stats = measurement(iteration, keys, kinds=OPTIMIZER_KINDS)
            log_layer_grad_norms(engine, iteration, writer, args)
        engine.history = [{**measurement(step, keys, kinds=OPTIMIZER_KINDS), "trigger": {"fired_at": 4}}
                          for step in (3, 4)]
        log_layer_grad_norms(engine, 5, writer, args)
    logged = scalars(str(tmp_path))
    expected = measurement(2, keys, kinds=OPTIMIZER_KINDS)
    for run, root, key in (("layer-grad-norms/layer01", "layer-grad-norms", 1),
                           ("layer-grad-norms/embed", "non-layer-grad-norms", "embed")):
        assert logged[run, f"{root}/update"][2] == pytest.approx(expected["update"][key]["norm"])
        assert logged[run, f"{root}/values/max/exp-avg-sq"][2] == pytest.approx(expected["exp_avg_sq"][key]["max"])
        assert logged[run, f"{root}/update-to-weight"][2] == pytest.approx(KIND_FACTORS["update"] /
                                                                           KIND_FACTORS["param"])
    assert {tag for _, tag in logged if "update-to-weight" in tag} == {  # a norm only
        f"{root}{history}/update-to-weight" for root in ("layer-grad-norms", "non-layer-grad-norms")
        for history in ("", "-history")}
    fire = "layer-grad-norms-history/fire-000004/layer00"
    assert sorted(logged[fire, "layer-grad-norms-history/update"]) == [3, 4]
    assert logged[fire, "layer-grad-norms-history/values/min/exp-avg"][3] == pytest.approx(
        expected["exp_avg"][0]["min"] * 1.003 / 1.002)
    assert sorted(logged[fire, "layer-grad-norms-history/update-to-weight"]) == [3, 4]

    layout = written_layout(str(tmp_path))
    assert list(layout) == [f"{root} {phase}" for phase in ("pre-clip", "post-clip", "param", "update", "exp-avg",
                                                             "exp-avg-sq", "update-to-weight")
                            for root in ("layer-grad-norms", "non-layer-grad-norms")]
    assert list(layout["layer-grad-norms update-to-weight"]) == ["norm"]
    assert re.match(layout["layer-grad-norms update"]["max"][0], "layer-grad-norms/values/max/update")

    series = read_layer_series(str(tmp_path))
    assert series.layers() == [0, 1]
    assert series.series("update", "norm", 1) == [(step, pytest.approx(measurement(step, keys, kinds=("update", ))[
        "update"][1]["norm"])) for step in range(1, 5)]
    assert [value for _, value in series.series("update-to-weight", "norm", 0)] == pytest.approx([0.0005] * 4)
    assert len(series.series("exp-avg-sq", "max", 0)) == 4
