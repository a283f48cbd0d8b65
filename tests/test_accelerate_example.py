"""examples/accelerate_loop.py as written, on 2 CPU ranks with the DeepSpeed launcher: the engine's
per-layer norms after each optimizer step of an Accelerate loop add up to its global norm."""

import os
import re

import pytest

from megatron_integration.cpu_launch import run_script

pytestmark = pytest.mark.extended  # CI runs it in its extended pass (tests/README.md)

pytest.importorskip("accelerate")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_accelerate_loop_runs_on_two_ranks():
    result = run_script(os.path.join(ROOT, "examples", "accelerate_loop.py"), timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = re.findall(r"step (\d+) grad_norm (\S+) root-sum-square (\S+)", result.stdout)
    assert [int(step) for step, _, _ in lines] == [1, 2, 3]
    for _, grad_norm, total in lines:
        assert float(total) == pytest.approx(float(grad_norm), rel=1e-5)
    assert "embed: " in result.stdout and "head: " in result.stdout
