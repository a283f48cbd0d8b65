"""What a user runs: the demo through the CLI, the README's quick-start through DeepSpeed's launcher."""

import glob
import json
import os
import subprocess
import sys
from typing import List

import pytest

from megatron_integration.cli import main
from megatron_integration.cpu_launch import run_script
from megatron_integration.fires import read_fires
from megatron_integration.plot import plot_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_end_to_end(tmp_path, capsys):
    """Into an ``--out`` that holds a longer demo's log: the demo starts its TensorBoard directory afresh. With a
    spike injected into layer 2 at step 6 (the first the trigger judges), a layer the default selection (0, 1, mid,
    -2, -1 of 6: 0, 1, 3, 4, 5) leaves out: the recorder catches it, the report's one-line answer names the layer and
    the step, and the gradient as the signal that moved first (the optimizer's statistics are on), its median says
    over which steps it was taken, and the main figure draws it."""
    from torch.utils.tensorboard import SummaryWriter

    from megatron_integration.training_log import write_tensorboard

    stale = {"step": 0, "pre_clip": {layer: {"norm": 1.0, "min": 0.0, "max": 1.0} for layer in range(5)}}
    with SummaryWriter(str(tmp_path / "tensorboard")) as writer:
        for step in range(1, 201):
            write_tensorboard(writer, dict(stale, step=step, post_clip=stale["pre_clip"]))
    main(["demo", "--steps", "8", "--num-layers", "6", "--hidden", "16", "--out", str(tmp_path), "--spike", "6:2"])
    output = capsys.readouterr().out
    assert "early/late ratio: " in output
    assert f"figure: {tmp_path / 'layer_grad_norms.png'}" in output
    assert (tmp_path / "layer_grad_norms.png").read_bytes()[:4] == b"\x89PNG"
    assert "in this run early layers' gradients (layers 0, 1)" in (tmp_path / "report.txt").read_text()
    assert max(len(line) for line in (tmp_path / "report.txt").read_text().splitlines()) <= 120
    main(["report", str(tmp_path / "tensorboard"), "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == [1, 8]  # not 1 to 200
    assert list(summary["median_norm"]) == ["0", "1", "2", "3", "4", "5"]  # 2: recorded and captured at the fire
    assert summary["median_steps"]["2"] == [5, 8, 4] and summary["median_steps"]["3"] == [5, 8, 4]
    main(["report", str(tmp_path / "layer_grad_norms.jsonl"), "--json"])  # the recorded steps, every kind
    (spike,) = json.loads(capsys.readouterr().out)["spikes"]
    assert (spike["fired_at"], spike["steps"], spike["rose_most"]) == (6, [1, 6], 2)
    assert spike["attribution"]["answer"].startswith("gradient of layer 2 rose first (step 6)")
    assert ": gradient of layer 2 rose first (step 6)" in spike["answer"]
    assert "; layer 2 rose most, " in spike["answer"]
    assert " ".join(spike["answer"].split()) in " ".join(output.split())  # the report's lines wrap at 120
    assert (tmp_path / "spike_history.png").read_bytes()[:4] == b"\x89PNG"
    figure = plot_run(str(tmp_path / "tensorboard"), str(tmp_path / "again.png"))
    for axis in figure.axes[:2]:  # pre- and post-clip: the default five and the spiked layer
        labels = [line.get_label() for line in axis.get_lines()]
        assert labels == ["layer 0", "layer 1", "layer 2", "layer 3", "layer 4", "layer 5"], labels
    drawn = {line.get_gid(): list(line.get_xdata()) for axis in figure.axes for line in axis.get_lines()}
    assert drawn["loss"] == drawn["global-norm"] == list(range(1, 9))  # the demo logs them as Megatron does


@pytest.mark.extended
def test_demo_with_a_learning_rate_spike_names_the_update_first(tmp_path, capsys):
    """The learning rate 3000x at step 6 only: every layer's update leaves its median there, and the weights it
    moved raise every layer's gradient at step 7, where the trigger fires. The report, on the demo's dump, says
    the update of every layer moved first (with its ratio to the weights) and the gradient followed; the dump holds
    every layer's update-to-weight ratio, which the spike figure draws."""
    main(["demo", "--steps", "7", "--num-layers", "6", "--hidden", "16", "--out", str(tmp_path), "--lr-spike", "6"])
    output = capsys.readouterr().out
    assert max(len(line) for line in (tmp_path / "report.txt").read_text().splitlines()) <= 120
    main(["report", str(tmp_path / "layer_grad_norms.jsonl"), "--json"])
    (spike,) = json.loads(capsys.readouterr().out)["spikes"]
    attribution = spike["attribution"]
    assert spike["fired_at"] == 7 and attribution["first"]["signal"] == "update" and attribution["first"]["step"] == 6
    assert attribution["answer"].startswith("update of every layer (6 of 6) rose first, step 6 ")  # not one layer
    assert [move["signal"] for move in attribution["followed"][:2]] == ["update_to_weight", "pre_clip"]
    assert attribution["followed"][1]["step"] == 7
    assert [attribution["layers"][str(layer)]["first"] for layer in range(6)] == ["update"] * 6
    assert " ".join(spike["answer"].split()) in " ".join(output.split())  # the report's lines wrap at 120
    (fire,) = read_fires(str(tmp_path / "layer_grad_norms.jsonl"))
    assert sorted(fire.series["update_to_weight"]) == list(range(6))
    assert (tmp_path / "spike_history.png").read_bytes()[:4] == b"\x89PNG"


def test_demo_rejects_a_spike_the_trigger_cannot_judge(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--steps", "20", "--spike", "5:0"])
    assert "--spike 5:0: the step must be from 6" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--num-layers", "4", "--spike", "8:4"])
    assert "--spike 8:4: the layer must be below --num-layers 4" in capsys.readouterr().err


def test_demo_rejects_a_bad_layer_spec(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--layers", "0,first"])
    assert "'first' is not a layer index or 'mid'" in capsys.readouterr().err


@pytest.mark.parametrize("command, fragments", [
    ("demo", ["optimizer steps (default: 200)", "(default: 0,1,mid,-2,-1)", "(default: runs/demo)"]),
    ("plot", ["a TensorBoard directory written by"]),
    ("report", ["a TensorBoard directory written by"]),
    ("patch", ["apply: add the feature", "check: exit 0 when applied", "revert: take it out"]),
])
def test_help_shows_defaults_and_says_what_each_argument_is(command, fragments, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    for fragment in fragments:
        assert fragment in text, text


@pytest.mark.extended  # 17 s, a launch of its own: the suite's margin under its 10 minutes (tests/README.md)
def test_readme_quickstart_runs_on_two_ranks():
    result = run_script(os.path.join(ROOT, "examples", "quickstart.py"), timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step 3 clip_coef" in result.stdout
    assert "  head  norm" in result.stdout


def test_patch_check_prints_its_one_line_only():
    """What scripts read from ``patch check``, in a fresh process: no DeepSpeed log line on stdout."""
    check = subprocess.run([sys.executable, "-m", "megatron_integration.cli", "patch", "check"], capture_output=True,
                           text=True, cwd=ROOT, timeout=120)
    assert check.returncode in (0, 1), check.stdout + check.stderr[-3000:]
    assert len(check.stdout.splitlines()) == 1 and "applied in " in check.stdout, check.stdout


def own_shm_buffers() -> List[str]:
    """The shared-memory files of this rank's launch: DeepSpeed's CPU all-reduce names them
    ``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` (csrc/cpu/comm/shm.cpp)."""
    address, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    return sorted(glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{address}_{port}_*"))


def test_launch_leaves_no_shared_memory_behind():
    """Only this launch's files are checked: other jobs on the machine may hold buffers of their own."""
    from deepspeed.accelerator import get_accelerator

    from megatron_integration.cpu_launch import launch

    if get_accelerator().device_name() != "cpu":
        pytest.skip("DeepSpeed's shared-memory all-reduce is CPU-only")
    seen = launch(own_shm_buffers, 2)
    assert seen[0] == seen[1] and len(seen[0]) == 2, seen  # one buffer per rank, both mapped by both ranks
    left_behind = [path for path in seen[0] if os.path.exists(path)]
    assert not left_behind, f"this launch left {left_behind}"


def test_the_ranks_drop_deepspeed_s_notice_of_its_communication_op_and_keep_the_rest(capsys):
    """Every rank prints it as ``init_distributed`` loads the op, built or cached: the demo printed it twice."""
    from megatron_integration import cpu_launch

    with cpu_launch._without_line(cpu_launch.SHM_COMM_OP_BUILT):
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        print("another line")
    assert capsys.readouterr().out == "another line\n"
