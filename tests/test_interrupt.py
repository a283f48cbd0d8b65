"""Ctrl-C on ``layer-grad-norms demo`` once its ranks train: one line, exit status 130, and no rank left.

The demo runs in a session of its own, as in a terminal. A terminal's Ctrl-C sends SIGINT to the whole foreground
process group (``terminal``); ``launcher`` sends it to the launcher alone, as ``kill -INT`` does. The ranks ignore
SIGINT (``cpu_launch.launch``), so in both cases the launcher stops them, and each rank must be gone when it exits.
The seconds from the signal to the launcher's exit are printed (``-s``), not judged: the machine is shared.
"""

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 100_000
TRAINING = re.compile(rf"demo:.*\b[1-9]\d*/{STEPS}\b")
"""tqdm's progress line once the last rank has finished a step."""


def read_until_training(process: subprocess.Popen, timeout: float = 300) -> str:
    """The launcher's output up to its first progress line with a finished step."""
    os.set_blocking(process.stdout.fileno(), False)
    output, deadline = "", time.monotonic() + timeout
    while not TRAINING.search(output):
        assert process.poll() is None and time.monotonic() < deadline, output[-3000:]
        time.sleep(0.2)
        output += (process.stdout.read() or b"").decode(errors="replace")
    os.set_blocking(process.stdout.fileno(), True)
    return output


@pytest.mark.extended
@pytest.mark.parametrize("target", ["terminal", "launcher"])
def test_ctrl_c_prints_one_line_and_stops_every_rank(target, tmp_path):
    command = [sys.executable, "-m", "megatron_integration.cli", "demo", "--steps", str(STEPS), "--num-layers", "2",
               "--hidden", "16", "--out", str(tmp_path)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        read_until_training(process)
        ranks = [child for child in psutil.Process(process.pid).children(recursive=True)
                 if "resource_tracker" not in " ".join(child.cmdline())]
        assert len(ranks) == 2, [child.cmdline() for child in ranks]
        sent = time.monotonic()
        (os.killpg if target == "terminal" else os.kill)(process.pid, signal.SIGINT)
        after = process.stdout.read().decode(errors="replace")  # to the launcher's exit
        status = process.wait(timeout=60)
        print(f"{target}: the launcher exited {time.monotonic() - sent:.2f} s after SIGINT")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert status == 130
    assert [rank.pid for rank in ranks if rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE] == []
    # What follows the progress bar (tqdm redraws it with carriage returns): the one line.
    lines = [line for line in re.split(r"[\r\n]", after) if line.strip() and not line.startswith("demo:")]
    assert lines == ["layer-grad-norms demo: interrupted"], after[-3000:]
