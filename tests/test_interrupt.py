"""Ctrl-C on ``layer-grad-norms demo`` once its ranks train: one line, exit status 130, and no rank left.

The demo runs in a session of its own, its output on a pseudo-terminal, as in a terminal (its progress bar is drawn
on a terminal only). A terminal's Ctrl-C sends SIGINT to the whole foreground
process group (``terminal``); ``launcher`` sends it to the launcher alone, as ``kill -INT`` does. The ranks ignore
SIGINT (``cpu_launch.launch``), so in both cases the launcher stops them, and each rank, and the fork server they
were started from, must be gone when it exits.
The seconds from the signal to the launcher's exit are printed (``-s``), not judged: the machine is shared.
"""

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 100_000
TRAINING = re.compile(rf"demo:.*\b[1-9]\d*/{STEPS}\b")
"""tqdm's progress line once the last rank has finished a step."""


def default_sigint() -> None:
    """In the demo's process, before it starts: SIGINT's default action, as a terminal's foreground command has it.
    A test run in the background of a non-interactive shell (``pytest &``, a CI script) inherits SIGINT ignored,
    which Python keeps: the launcher would never see the Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def running(process: psutil.Process) -> bool:
    """Whether ``process`` still runs: neither gone nor a zombie waiting to be reaped."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def read_available(terminal: int, wait: float = 0.2) -> str:
    """What the pseudo-terminal ``terminal`` holds now, waiting up to ``wait`` seconds for the first of it."""
    chunks = []
    while select.select([terminal], [], [], wait)[0]:
        try:
            chunk = os.read(terminal, 65536)
        except OSError:  # EIO: every process holding the terminal has closed it
            break
        if not chunk:
            break
        chunks.append(chunk)
        wait = 0
    return b"".join(chunks).decode(errors="replace")


def read_until_training(process: subprocess.Popen, terminal: int, timeout: float = 300) -> str:
    """The launcher's output up to its first progress line with a finished step."""
    output, deadline = "", time.monotonic() + timeout
    while not TRAINING.search(output):
        assert process.poll() is None and time.monotonic() < deadline, output[-3000:]
        output += read_available(terminal)
    return output


def read_until_exit(process: subprocess.Popen, terminal: int, timeout: float = 60) -> str:
    """The launcher's output to its exit, and what its ranks wrote before they closed the terminal."""
    output, deadline = "", time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        output += read_available(terminal)
    return output + read_available(terminal, wait=1.0)


@pytest.mark.extended
@pytest.mark.parametrize("target", ["terminal", "launcher"])
def test_ctrl_c_prints_one_line_and_stops_every_rank(target, tmp_path):
    command = [sys.executable, "-m", "megatron_integration.cli", "demo", "--steps", str(STEPS), "--num-layers", "2",
               "--hidden", "16", "--out", str(tmp_path)]
    terminal, attached = pty.openpty()
    fcntl.ioctl(attached, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # a terminal's size: tqdm's width
    process = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=attached, stderr=attached,
                               start_new_session=True, preexec_fn=default_sigint)
    os.close(attached)
    try:
        read_until_training(process, terminal)
        children = [child for child in psutil.Process(process.pid).children(recursive=True)
                    if "resource_tracker" not in " ".join(child.cmdline())]
        servers = [child for child in children if child.ppid() == process.pid]  # the ranks' fork server
        ranks = [child for child in children if child not in servers]
        assert len(servers) == 1 and len(ranks) == 2, [(child.ppid(), child.cmdline()) for child in children]
        sent = time.monotonic()
        (os.killpg if target == "terminal" else os.kill)(process.pid, signal.SIGINT)
        after = read_until_exit(process, terminal)
        status = process.wait(timeout=60)
        print(f"{target}: the launcher exited {time.monotonic() - sent:.2f} s after SIGINT")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        os.close(terminal)
    assert status == 130
    assert [rank.pid for rank in ranks if running(rank)] == []
    # The fork server leaves on its own once it sees its launcher gone: a moment later on a loaded machine.
    deadline = time.monotonic() + 30
    while any(running(server) for server in servers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [server.pid for server in servers if running(server)] == []
    # What follows the progress bar (tqdm redraws it with carriage returns): the one line.
    lines = [line for line in re.split(r"[\r\n]", after) if line.strip() and not line.startswith("demo:")]
    assert lines == ["layer-grad-norms demo: interrupted"], after[-3000:]
