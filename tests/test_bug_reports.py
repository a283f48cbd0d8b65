"""The reproductions of the bugs reported in ``deepspeed_patch/upstream/bug_reports/`` still
show them on the pinned release: when one of these fails, DeepSpeed has changed the behaviour, and the
report, the README's notes and ``clipping.zero_unscale_divisor`` need another look."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.extended  # CI runs it in its extended pass (tests/README.md)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUG_REPORTS = os.path.join(REPO, "deepspeed_patch", "upstream", "bug_reports")
# what both scripts train: sum(x @ w) over these rows, whose gradient is the column sums
INPUTS = torch.tensor([[1.0, 0.0, 2.0, 1.0], [0.0, 1.0, 1.0, 2.0]])
GRADIENT = INPUTS.sum(dim=0).tolist()


def run_script(name: str, *args: str) -> dict:
    """Run a reproduction on one CPU rank and return what it printed as JSON."""
    import deepspeed

    env = {**os.environ, "PYTHONPATH": ""}  # the scripts stand alone, as they do for DeepSpeed's maintainers
    # DeepSpeed JIT-builds its CPU communication op into TORCH_EXTENSIONS_DIR; one folder per release, so
    # that another release's build in the shared default folder cannot be loaded by mistake
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions",
                                                        f"layer-grad-norms-bug-reports-{deepspeed.__version__}"))
    result = subprocess.run([sys.executable, os.path.join(BUG_REPORTS, name), "--json", *args], capture_output=True,
                            text=True, env=env, cwd=BUG_REPORTS, timeout=900)
    output = result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), output
    # The JSON line comes after the last collective and destroy_process_group. Once, under load, the
    # interpreter then aborted at exit ("terminate called without an active exception": a C++ thread of
    # DeepSpeed's CPU communication op or of gloo torn down): that does not touch the result; anything
    # else does.
    assert result.returncode == 0 or "terminate called without an active exception" in result.stderr, output
    return json.loads(lines[-1])


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_unscales_with_the_next_steps_loss_scale(stage):
    """On a step where the loss scale grows, ZeRO-1/2 applies gradient * old/new scale; on the others,
    the gradient."""
    found = run_script("zero_unscale_after_scale_update.py", "--stage", str(stage), "--steps", "5")
    rows = found["rows"]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    grew = [row for row in rows if row["loss_scale_after_step"] > row["loss_scale_in_backward"]]
    assert [row["step"] for row in grew] == [3, 5]
    for row in rows:
        assert row["expected_update"] == GRADIENT
        factor = row["loss_scale_in_backward"] / row["loss_scale_after_step"]
        assert row["applied_update"] == [value * factor for value in GRADIENT], row
    assert {row["applied_over_expected"][0] for row in grew} == {0.5}


def test_stage0_fp16_divides_by_a_loss_scale_the_loss_never_carried():
    """Without ZeRO, fp16 applies gradient / loss scale: the loss was never multiplied by it."""
    found = run_script("stage0_unscaled_loss.py", "--dtype", "fp16", "--steps", "2")
    assert [row["step"] for row in found["rows"]] == [1, 2]
    for row in found["rows"]:
        assert row["optimizer"] == "FP16_UnfusedOptimizer"
        assert row["loss_scale"] == 256.0
        assert row["expected_update"] == GRADIENT
        assert row["applied_update"] == [value / 256 for value in GRADIENT], row


def test_gloo_rank_left_to_interpreter_exit_exits_0_or_aborts_with_the_gloo_worker_s_message():
    """torch's bug (gloo_exit_abort.md): each rank exits 0 or dies of SIGABRT having printed "terminate called
    without an active exception"; how many abort is a race, printed by the script, not asserted."""
    found = run_script("gloo_exit_abort.py", "--runs", "6", "--collectives", "20")
    assert len(found["runs"]) == 6
    outcomes = [outcome for run in found["runs"] for outcome in zip(run["returncodes"], run["terminate_called"])]
    assert len(outcomes) == 12 and set(outcomes) <= {(0, False), (-6, True)}, outcomes
    assert found["aborted"] == sum(-6 in run["returncodes"] for run in found["runs"])
