"""``launch`` gives each rank its share of the cores and the launcher's environment at launch (two real launches);
``run_script`` launches a script again after torch's gloo exit abort, once, and after nothing else (the launcher
is faked, so each case says which launches ended how)."""

import os
import subprocess
from typing import List

import pytest

from megatron_integration import cpu_launch

ABORTED = subprocess.CompletedProcess([], 250, "step 3\n",
                                      f"exits with return code = -6\n{cpu_launch.GLOO_EXIT_ABORT}\n")
CLEAN = subprocess.CompletedProcess([], 0, "step 3\n", "")
FAILED = subprocess.CompletedProcess([], 1, "", "Traceback (most recent call last):\nValueError: layers\n")
ABORTED_OTHERWISE = subprocess.CompletedProcess([], 250, "", "exits with return code = -6\n")

MARK = "LAYER_GRAD_NORMS_LAUNCH_MARK"


def threads_and_mark() -> tuple:
    import torch

    return torch.get_num_threads(), os.environ.get(MARK)


def test_each_rank_gets_its_share_of_the_cores_and_the_environment_at_launch(monkeypatch):
    cpu_launch.launch(threads_and_mark, 1)  # the fork server runs by now at the latest, before the mark is set
    monkeypatch.setenv(MARK, "set after the fork server started")
    share = max(1, (os.cpu_count() or 1) // 2)
    assert cpu_launch.launch(threads_and_mark, 2) == [(share, "set after the fork server started")] * 2


def fake_launcher(monkeypatch, outcomes: List[subprocess.CompletedProcess]) -> List[list]:
    """The launches ``run_script`` makes, answered by ``outcomes`` in order."""
    launches = []

    def run(command, **kwargs):
        launches.append(command)
        return outcomes[len(launches) - 1]

    monkeypatch.setattr(cpu_launch.subprocess, "run", run)
    return launches


def test_an_exit_abort_is_launched_again_with_a_warning(monkeypatch):
    launches = fake_launcher(monkeypatch, [ABORTED, CLEAN])
    with pytest.warns(UserWarning, match="gloo exit abort"):
        result = cpu_launch.run_script("script.py")
    assert result is CLEAN and len(launches) == 2


def test_what_the_aborted_launch_wrote_is_removed_before_the_launch_again_and_only_then(monkeypatch):
    """A script that writes files must not find the aborted launch's beside its own (two TensorBoard runs in one
    folder make ``report`` ask which): ``before_relaunch`` runs between the two launches, and not after a clean
    one."""
    launches, removed_after = fake_launcher(monkeypatch, [ABORTED, CLEAN]), []
    with pytest.warns(UserWarning):
        cpu_launch.run_script("script.py", before_relaunch=lambda: removed_after.append(len(launches)))
    assert removed_after == [1] and len(launches) == 2

    launches, removed_after = fake_launcher(monkeypatch, [CLEAN]), []
    cpu_launch.run_script("script.py", before_relaunch=lambda: removed_after.append(len(launches)))
    assert removed_after == [] and len(launches) == 1


def test_two_exit_aborts_in_a_row_fail(monkeypatch):
    launches = fake_launcher(monkeypatch, [ABORTED, ABORTED, CLEAN])
    with pytest.warns(UserWarning):
        result = cpu_launch.run_script("script.py")
    assert result is ABORTED and len(launches) == 2


@pytest.mark.parametrize("outcome", [CLEAN, FAILED, ABORTED_OTHERWISE],
                         ids=["clean", "error", "abort-without-message"])
def test_anything_else_is_launched_once(monkeypatch, recwarn, outcome):
    launches = fake_launcher(monkeypatch, [outcome, CLEAN])
    assert cpu_launch.run_script("script.py") is outcome and len(launches) == 1
    assert not [w for w in recwarn if "gloo exit abort" in str(w.message)]
