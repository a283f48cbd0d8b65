"""What a user runs: the demo through the CLI, the README's quick-start through DeepSpeed's launcher."""

import json
import os
import subprocess

import pytest

from megatron_integration.cli import main
from megatron_integration.cpu_launch import free_port, remove_shm_buffers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_end_to_end(tmp_path, capsys):
    """Into an ``--out`` that holds a longer demo's log: the demo starts its TensorBoard directory afresh."""
    from torch.utils.tensorboard import SummaryWriter

    from megatron_integration.training_log import write_tensorboard

    stale = {"step": 0, "pre_clip": {layer: {"norm": 1.0, "min": 0.0, "max": 1.0} for layer in range(5)}}
    with SummaryWriter(str(tmp_path / "tensorboard")) as writer:
        for step in range(1, 201):
            write_tensorboard(writer, dict(stale, step=step, post_clip=stale["pre_clip"]))
    main(["demo", "--steps", "6", "--num-layers", "5", "--hidden", "16", "--layers", "0,1,mid,-2,-1",
          "--out", str(tmp_path)])
    output = capsys.readouterr().out
    assert "early/late ratio: " in output
    assert f"figure: {tmp_path / 'layer_grad_norms.png'}" in output
    assert (tmp_path / "layer_grad_norms.png").read_bytes()[:4] == b"\x89PNG"
    assert "in this run early layers' gradients (layers 0, 1)" in (tmp_path / "report.txt").read_text()
    main(["report", str(tmp_path / "tensorboard"), "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == [1, 6]  # not 1 to 200
    assert list(summary["median_norm"]) == ["0", "1", "2", "3", "4"]  # 0, 1, mid = 2, -2 = 3, -1 = 4


def test_demo_rejects_a_bad_layer_spec(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--layers", "0,first"])
    assert "'first' is not a layer index or 'mid'" in capsys.readouterr().err


def test_readme_quickstart_runs_on_two_ranks():
    port = free_port()
    try:
        result = subprocess.run(["deepspeed", "--num_gpus", "2", "--master_port", str(port),
                                 os.path.join(ROOT, "examples", "quickstart.py")],
                                capture_output=True, text=True, timeout=300, cwd=ROOT)
    finally:
        remove_shm_buffers(port)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step 3 clip_coef" in result.stdout
    assert "  head  norm" in result.stdout


def test_launch_leaves_no_shared_memory_behind():
    import glob

    from megatron_integration.cpu_launch import launch

    before = set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"))
    assert len(launch(os.getpid, 2)) == 2
    assert set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*")) <= before
