"""Every bad input to the command line is one line on stderr and exit code 2, never a traceback; bad ds_config
values name the key and the value."""

import subprocess
import sys

import pytest

from deepspeed_patch.config import LayerGradNormsConfigError, load_config
from megatron_integration.cli import main


def one_line_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def logs(tmp_path):
    """A binary file, an events file, a text file that is no log, and a JSONL dump of three layers."""
    import json

    from torch.utils.tensorboard import SummaryWriter

    (tmp_path / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "notes.txt").write_text("not a log\n")
    with SummaryWriter(str(tmp_path / "tb")) as writer:
        for step in range(1, 5):
            for layer in range(3):
                writer.add_scalar(f"layer-grad-norms/pre-clip/layer{layer:02d}", 1.0 + layer, step)
    with open(tmp_path / "dump.jsonl", "w") as dump:
        for step in range(1, 5):
            buckets = {str(layer): {"norm": 1.0, "min": 0.0, "max": 1.0} for layer in range(3)}
            dump.write(json.dumps({"step": step, "pre_clip": buckets, "post_clip": buckets}) + "\n")
    return tmp_path


@pytest.mark.parametrize("command", ["report", "plot"])
def test_a_path_that_does_not_exist_says_so(command, tmp_path, capsys):
    assert "no such file or directory" in one_line_error([command, str(tmp_path / "missing")], capsys)


@pytest.mark.parametrize("command", ["report", "plot"])
def test_a_binary_or_foreign_file_is_named_as_such(command, logs, capsys):
    assert "a binary file, not a log read here" in one_line_error([command, str(logs / "binary.bin")], capsys)
    assert "not a log read here" in one_line_error([command, str(logs / "notes.txt")], capsys)


def test_an_events_file_given_directly_is_read(logs, capsys):
    (events,) = (logs / "tb").glob("events.out.tfevents.*")
    main(["report", str(events)])
    text = capsys.readouterr().out
    assert "  layer   0: 1.0000e+00\n" in text and "this run logs 3 (layers 0, 1, 2)" in text  # 3 layers: no ratio


@pytest.mark.parametrize("output, message", [("x.jpgx", "unknown figure format 'jpgx'"),
                                             ("missing_dir/f.png", "does not exist")])
def test_plot_refuses_an_output_it_cannot_write_before_reading(output, message, logs, capsys):
    assert message in one_line_error(["plot", str(logs / "dump.jsonl"), "-o", str(logs / output)], capsys)


@pytest.mark.parametrize("argv, message", [
    (["--layers", "0,99"], "--layers 0,99: layer 99 is out of range for a model with 12 transformer layers"),
    (["--layers", "3"], "select at least 2 layers"),
    (["--layers", '[0, 1, "mid"]'], "expected \"all\" or a comma-separated list such as 0,1,mid,-2,-1"),
    (["--num-layers", "4", "--spike", "8:4"], "--spike 8:4: the layer must be below --num-layers 4"),
    (["--steps", "20", "--lr-spike", "4"], "--lr-spike 4: the step must be from 5 to --steps 20 - 1"),
    (["--steps", "20", "--lr-spike", "20"], "--lr-spike 20: the step must be from 5 to --steps 20 - 1"),
    (["--hidden", "30"], "--hidden 30: must be a multiple of 4"),
    (["--steps", "0"], "'0' is not a positive integer"),
])
def test_bad_demo_options_are_refused_before_any_rank_launches(argv, message, capsys, monkeypatch):
    import megatron_integration.cli as cli

    monkeypatch.setattr(cli, "run_demo", lambda options: pytest.fail("launched"))
    assert message in one_line_error(["demo", *argv], capsys)


def test_layers_takes_what_its_help_says(capsys, monkeypatch):
    import megatron_integration.cli as cli

    launched = []
    monkeypatch.setattr(cli, "run_demo", lambda options: launched.append(options.layers) or "")
    for spec in ("all", "0,1,mid,-2,-1"):
        main(["demo", "--layers", spec])
    assert launched == ["all", "0,1,mid,-2,-1"]
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "comma-separated list such as 0,1,mid,-2,-1" in " ".join(capsys.readouterr().out.split())


def test_megatron_e2e_refuses_a_missing_fork(tmp_path, capsys):
    assert "--fork" in one_line_error(["megatron-e2e", "--fork", str(tmp_path / "missing")], capsys)


def test_the_command_itself_prints_one_line_and_no_traceback(tmp_path):
    """In a fresh process, as a user runs it: not even DeepSpeed's notice that it fell back to the CPU."""
    result = subprocess.run([sys.executable, "-m", "megatron_integration.cli", "report", str(tmp_path / "missing")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    expected = f"layer-grad-norms report: {tmp_path / 'missing'}: no such file or directory"
    assert result.stderr.splitlines() == [expected], result.stderr


@pytest.mark.parametrize("block, message", [
    ({"trigger": {"grad_norm_factr": 2.0}},
     "layer_grad_norms.trigger.grad_norm_factr=2.0: unknown key; known keys are "
     "['capture_steps', 'cooldown', 'grad_norm_factor'"),
    ({"dump": {"path": "x", "max_byte": 10}}, "layer_grad_norms.dump.max_byte=10: unknown key; known keys are"),
    ({"enabled": "yes"}, "layer_grad_norms.enabled='yes': expected true or false"),
    ({"enabled": 1}, "layer_grad_norms.enabled=1: expected true or false"),
    ({"monitor": "false"}, "layer_grad_norms.monitor='false': expected true or false"),
    ({"trigger": {"on_overflow": "no"}}, "layer_grad_norms.trigger.on_overflow='no': expected true or false"),
])
def test_nested_keys_are_listed_and_booleans_are_strict(block, message):
    with pytest.raises(LayerGradNormsConfigError) as error:
        load_config({"layer_grad_norms": block})
    assert message in str(error.value)


@pytest.mark.parametrize("block, message", [
    ({"interval": "10"}, "layer_grad_norms.interval='10': expected an integer"),
    ({"interval": 2.0}, "layer_grad_norms.interval=2.0: expected an integer"),
    ({"control_interval": True}, "layer_grad_norms.control_interval=True: expected an integer"),
    ({"trigger": {"window": "5"}}, "layer_grad_norms.trigger.window='5': expected an integer"),
    ({"trigger": {"grad_norm_factor": "2.5"}}, "layer_grad_norms.trigger.grad_norm_factor='2.5': expected a number"),
    ({"trigger": {"loss_factor": False}}, "layer_grad_norms.trigger.loss_factor=False: expected a number"),
    ({"dump": {"path": "x", "max_bytes": "2000"}}, "layer_grad_norms.dump.max_bytes='2000': expected an integer"),
    ({"dump": {"path": 3}}, "layer_grad_norms.dump.path=3: expected a string"),
    ({"layer_pattern": 5}, "layer_grad_norms.layer_pattern=5: expected a string"),
    ({"trigger": "on"}, "layer_grad_norms.trigger='on': expected a JSON object"),
])
def test_numbers_and_strings_are_strict_as_booleans_are(block, message):
    """A value of another type is refused in one line naming the key and the value, never converted: a string of
    digits is no integer, a float no integer, a boolean no number."""
    with pytest.raises(LayerGradNormsConfigError) as error:
        load_config({"layer_grad_norms": block})
    assert str(error.value) == f"invalid ds_config block: {message}"


def test_an_integer_is_still_a_number():
    config = load_config({"layer_grad_norms": {"trigger": {"grad_norm_factor": 2, "loss_factor": 3}}})
    assert (config.trigger.grad_norm_factor, config.trigger.loss_factor) == (2.0, 3.0)


def test_a_bad_block_through_deepspeed_initialize_is_one_exception_whose_first_line_is_the_message():
    """On one rank, through ``deepspeed.initialize`` as a user calls it: the launcher's exception opens with the
    rank's own message, naming key and value, and says it once."""
    from megatron_integration.cpu_launch import RankFailed, launch
    from setup_workers import base_config, installed_initialize

    with pytest.raises(RankFailed) as failure:
        launch(installed_initialize, 1, base_config(layer_grad_norms={"enabled": True, "interval": "10"}))
    message = "invalid ds_config block: layer_grad_norms.interval='10': expected an integer"
    lines = str(failure.value).splitlines()
    assert lines[0] == f"rank 0: deepspeed_patch.config.LayerGradNormsConfigError: {message}", lines[0]
    assert str(failure.value).count(message) == 1 and "Traceback" in lines[3], str(failure.value)


@pytest.mark.parametrize("out, message", [
    ("report.txt", "--out {out}: a file, not a directory"),
    ("report.txt/demo", "is a file, not a directory"),
    ("/sys/demo", "--out /sys/demo: cannot write in /sys (Permission denied)"),
    ("/sys", "--out /sys: cannot write in /sys (Permission denied)"),
])
def test_demo_checks_its_out_folder_before_any_rank_launches(out, message, tmp_path, capsys, monkeypatch):
    """A file, a path under a file, a folder no one may write in (/sys: read-only even for root, whom a
    folder's mode bits do not stop), and under one."""
    import megatron_integration.cli as cli

    monkeypatch.setattr(cli, "run_demo", lambda options: pytest.fail("launched"))
    (tmp_path / "report.txt").write_text("a file\n")
    out = out if out.startswith("/") else str(tmp_path / out)
    assert message.format(out=out) in one_line_error(["demo", "--out", out], capsys)


def run_cli(*argv: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatron_integration.cli", *argv], stderr=subprocess.PIPE,
                            text=True, **popen)


def test_the_demo_command_refuses_a_read_only_out_in_one_line():
    """Through the entry point, as a user runs it: no rank launched, no traceback."""
    command = run_cli("demo", "--out", "/sys/demo")
    _, err = command.communicate(timeout=300)
    assert command.returncode == 2
    assert err.splitlines() == ["layer-grad-norms: error: --out /sys/demo: cannot write in /sys (Permission denied)"]


@pytest.mark.parametrize("options", [[], ["--json"]])
def test_a_report_piped_into_a_reader_that_stops_early_ends_quietly(options, logs):
    """``report | head -3``: the read end is closed before the report is written, so every write fails."""
    command = run_cli("report", *options, str(logs / "dump.jsonl"), stdout=subprocess.PIPE)
    command.stdout.close()
    err = command.stderr.read()
    assert command.wait(timeout=300) == 141 and err == "", err
