"""The Megatron side: flags, the ds_config they fill, and the training-log hook into TensorBoard."""

import argparse
import json
import logging

import pytest

from megatron_integration import layer_grad_norms_ds_config
from megatron_integration.cpu_launch import launch
from megatron_integration.training_log import custom_scalars_layout, log_string_field, scalar_tag
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


@pytest.mark.parametrize("flags,message", [
    (["--layer-grad-norms-layers", "0,last"], "--layer-grad-norms-layers='0,last': 'last' is not a layer index"),
    (["--layer-grad-norms-interval", "0"], "--layer-grad-norms-interval=0: must be 1 or more"),
])
def test_bad_flags_name_the_flag_and_value(flags, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        layer_grad_norms_ds_config(megatron_args(FLAGS + flags), {})


def test_log_string_field_format():
    stats = {"pre_clip": {0: {"norm": 0.25}, 11: {"norm": 1.5}, "embed": {"norm": 3.0}}}
    assert log_string_field(stats) == " layer grad norm: 0: 2.500E-01 | 11: 1.500E+00 |"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """2 pipeline stages on 2 ranks, 6 iterations, TensorBoard every 2, log line every 4."""
    tensorboard_dir = str(tmp_path_factory.mktemp("tensorboard"))
    return tensorboard_dir, launch(train_with_training_log, 2, tensorboard_dir, FLAGS, STEPS)


def scalars(tensorboard_dir: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tensorboard_dir, size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def test_tensorboard_holds_every_logged_layer_statistic(run):
    tensorboard_dir, records = run
    events = scalars(tensorboard_dir)
    last = records[-1]
    logged = {i + 1: m for i, m in enumerate(last["measured"]) if (i + 1) % 2 == 0}
    assert sorted(logged) == [2, 4, 6]
    for iteration, measured in logged.items():
        assert measured["step"] == iteration
        assert sorted(k for k in measured["pre_clip"] if isinstance(k, int)) == [0, 1, 3, 4, 5]  # 6 layers
        for phase in ("pre_clip", "post_clip"):
            for key, values in measured[phase].items():
                for statistic in ("norm", "min", "max"):
                    tag = scalar_tag(phase, statistic, key)
                    by_step = {event.step: event.value for event in events.Scalars(tag)}
                    assert by_step[iteration] == pytest.approx(values[statistic], rel=1e-6)
                    samples = {event.step: event.value for event in events.Scalars(tag + " vs samples")}
                    assert samples[iteration * 4] == pytest.approx(values[statistic], rel=1e-6)
    assert sorted(event.step for event in events.Scalars(scalar_tag("pre_clip", "norm", 0))) == [2, 4, 6]


def test_tensorboard_has_the_custom_scalars_layout(run):
    from tensorboard.plugins.custom_scalar import metadata

    tensorboard_dir, _ = run
    events = scalars(tensorboard_dir)
    assert metadata.CONFIG_SUMMARY_TAG in events.Tags()["tensors"]
    layout = custom_scalars_layout()
    assert set(layout) == {"layer-grad-norms pre-clip", "layer-grad-norms post-clip"}


def test_log_line_on_log_interval_iterations_only_and_no_collective(run):
    _, records = run
    for record in records:
        assert record["collectives_in_log_call"] == 0
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
    assert {"a/megatron/arguments.py", "a/megatron/training.py"} == set(re.findall(r"^--- (\S+)$", patch, re.M))
