"""Run a function on N CPU ranks (gloo) in fresh processes and collect what each rank returns.

Used by the demo and the tests: no launcher, no hostfile, a free loopback port per launch.
"""

import contextlib
import glob
import io
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import traceback
import warnings
from multiprocessing.context import BaseContext
from typing import Any, Callable, Iterator, List, Optional, Tuple, TypeVar

import torch.multiprocessing as mp

SHM_COMM_OP = "deepspeed_shm_comm"
"""DeepSpeed's CPU communication op (``ShareMemCommBuilder``), built on first use by ``init_distributed``."""


class _NoCpuFallbackNotice(logging.Filter):
    """Drops DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to
    detect it.", logged at its import wherever no GPU is found: the ranks launched here are CPU ranks by design,
    and ``plot``, ``report`` and ``patch`` use no accelerator; every other DeepSpeed message passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Setting accelerator to CPU.")


def quiet_cpu_fallback_notice() -> None:
    """Install the filter on DeepSpeed's logger (made by name, so this works before DeepSpeed is imported)."""
    logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _NoCpuFallbackNotice) for f in logger.filters):
        logger.addFilter(_NoCpuFallbackNotice())


def announce_shm_comm_build() -> None:
    """One line on stderr before ranks on the CPU accelerator build DeepSpeed's communication op the first time
    (a minute or two of silence otherwise); nothing once it is in the torch extensions cache."""
    from deepspeed.accelerator import get_accelerator
    from torch.utils import cpp_extension

    if get_accelerator().device_name() != "cpu":
        return
    build_dir = cpp_extension._get_build_directory(SHM_COMM_OP, verbose=False)
    if not os.path.exists(os.path.join(build_dir, f"{SHM_COMM_OP}.so")):
        print(f"building DeepSpeed's CPU communication op ({SHM_COMM_OP}, C++) into {build_dir}, once: about a "
              "minute on 2 cores", file=sys.stderr, flush=True)


class RankFailed(RuntimeError):
    """A rank's exception, re-raised in the launcher: its first line is the rank's own message, said once (what a
    user reads first), and the rank's traceback, which leads to it, below."""

    def __init__(self, rank: int, rank_traceback: str) -> None:
        *frames, message = rank_traceback.rstrip().splitlines() or ["no traceback"]
        super().__init__("\n".join([f"rank {rank}: {message}", "", "the rank's traceback, which led to it:", *frames]))
        self.rank = rank


DEPRECATED_GATHER = r"`torch\.distributed\.all_gather_into_tensor` is deprecated"
"""torch 2.13's FutureWarning at DeepSpeed's own call of it (``TorchBackend.all_gather_into_tensor``, ZeRO's
all-gather of the updated weights), printed once by every rank: DeepSpeed's to change, nothing a user of the demo
can act on."""
SHM_COMM_OP_BUILT = "deepspeed_shm_comm_op built successfully"
"""The end of the line DeepSpeed prints on every rank as ``init_distributed`` loads its CPU communication op, built
or cached (``announce_shm_comm_build`` already says when it is built)."""


@contextlib.contextmanager
def _without_line(ending: str) -> Iterator[None]:
    """What the block prints to stdout, less the lines ending with ``ending``."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            yield
    finally:
        lines = printed.getvalue().splitlines(keepends=True)
        sys.stdout.write("".join(line for line in lines if not line.rstrip().endswith(ending)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def share_cores(world_size: int) -> None:
    """Give this rank its share of the machine's cores as torch's intra-op threads. Each rank would otherwise
    start one thread per core, so N ranks would run N times as many threads as there are cores, and their
    spinning waits at every collective slow a 2-rank launch on 2 cores about 2.5-fold (``torchrun`` sets
    ``OMP_NUM_THREADS=1`` for the same reason)."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))


def _rank_context() -> BaseContext:
    """Ranks are forked from one server process that has imported torch (``forkserver``, started on the first
    launch and kept until this process ends): each rank then starts in well under a second instead of importing
    torch itself, about 3 s of a core per rank. DeepSpeed is not preloaded: a test may launch ranks on another
    copy of it, found through ``sys.path``, which each rank imports afresh."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch"])
    return context


def _worker(rank: int, world_size: int, port: int, environ: dict, fn: Callable, args: tuple, queue) -> None:
    # Ctrl-C reaches the launcher only, which stops every rank at once; a rank prints no KeyboardInterrupt of
    # its own. The environment is the launcher's at launch, not the fork server's at its start.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size))
    try:
        share_cores(world_size)
        quiet_cpu_fallback_notice()
        warnings.filterwarnings("ignore", message=DEPRECATED_GATHER, category=FutureWarning)
        import deepspeed

        from .cpu_compat import apply_cpu_compat

        apply_cpu_compat()
        with _without_line(SHM_COMM_OP_BUILT):
            deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        # Plain pickle: tensors travel as bytes, not as shared memory that dies with this process.
        queue.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def launch(fn: Callable, world_size: int, *args: Any, timeout: float = 600) -> List[Any]:
    """``fn(*args)`` on every rank; returns the results by rank. A hang past ``timeout`` fails."""
    announce_shm_comm_build()
    context = _rank_context()
    queue = context.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        context.Process(target=_worker, args=(rank, world_size, port, environ, fn, args, queue), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: List[Any] = [None] * world_size
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise RankFailed(rank, value)
            results[rank] = pickle.loads(value)
    except BaseException:  # a rank failed, a hang, or Ctrl-C: no rank goes on training
        for proc in procs:
            proc.terminate()
        raise
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        queue.close()  # its semaphore released now, not reported leaked at an interrupted exit
        remove_shm_buffers(port)
    return results


def remove_shm_buffers(port: int, address: str = "127.0.0.1") -> None:
    """Delete the shared-memory buffers DeepSpeed's CPU all-reduce leaves behind (69 MB a rank, never
    unlinked in 0.19.8): without this, each launch leaks them until /dev/shm fills up."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{address}_{port}_*"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


Launched = TypeVar("Launched")

GLOO_EXIT_ABORT = "terminate called without an active exception"
"""What a rank prints as torch's gloo worker thread aborts it at interpreter exit, its work done (docs/supported.md,
"Exiting"; ``deepspeed_patch/upstream/bug_reports/gloo_exit_abort.md``): the rank dies of SIGABRT, the launcher
returns 250."""


def exit_aborted(returncode: int, output: str) -> bool:
    """Whether a launch failed by torch's gloo exit abort: the launcher's 250 for a rank's SIGABRT, with its
    message in the launch's ``output``."""
    return returncode == 250 and GLOO_EXIT_ABORT in output


def relaunch_after_exit_abort(launch: Callable[[], Launched], ending: Callable[[Launched], Tuple[int, str]],
                              say: Callable[[str], None], name: str, retries: int = 1,
                              before_relaunch: Optional[Callable[[], None]] = None) -> Launched:
    """``launch()`` again, up to ``retries`` times, while it fails by torch's gloo exit abort (``exit_aborted`` of
    its ``ending``: exit status and output), ``say``ing so: that abort is torch's, made likelier by any collective
    near the exit, the statistics' included (docs/supported.md), and rare enough that two in a row say something
    else is wrong. ``before_relaunch`` runs before each launch again: a launch that writes files gives it what
    removes the aborted launch's, so that what is read afterwards comes from one launch alone. Every launcher here
    that judges a launch by its exit status goes through this."""
    for attempt in range(retries + 1):
        launched = launch()
        if attempt == retries or not exit_aborted(*ending(launched)):
            return launched
        say(f"{name}: a rank aborted at exit ({GLOO_EXIT_ABORT!r}, torch's gloo exit abort); launched again")
        if before_relaunch is not None:
            before_relaunch()


def run_script(script: str, num_ranks: int = 2, timeout: float = 600, cwd: Optional[str] = None,
               exit_abort_retries: int = 1,
               before_relaunch: Optional[Callable[[], None]] = None) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus num_ranks script`` (CPU ranks), its output captured; its shared-memory buffers
    removed whatever happens. Launched again, with a warning, after torch's gloo exit abort
    (``relaunch_after_exit_abort``, up to ``exit_abort_retries`` times, ``before_relaunch`` first)."""
    return relaunch_after_exit_abort(lambda: _launch_script(script, num_ranks, timeout, cwd),
                                     lambda result: (result.returncode, result.stdout + result.stderr),
                                     # the warning names run_script's caller: past this lambda and the helper
                                     lambda message: warnings.warn(message, stacklevel=4),
                                     script,
                                     retries=exit_abort_retries,
                                     before_relaunch=before_relaunch)


def _launch_script(script: str, num_ranks: int, timeout: float, cwd: Optional[str]) -> subprocess.CompletedProcess:
    port = free_port()
    try:
        return subprocess.run(["deepspeed", "--num_gpus", str(num_ranks), "--master_port", str(port), script],
                              capture_output=True, text=True, timeout=timeout, cwd=cwd)
    finally:
        remove_shm_buffers(port)
