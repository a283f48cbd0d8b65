"""Run a function on N CPU ranks (gloo) in fresh processes and collect what each rank returns.

Used by the demo and the tests: no launcher, no hostfile, a free loopback port per launch.
"""

import contextlib
import glob
import os
import pickle
import socket
import subprocess
import traceback
from typing import Any, Callable, List, Optional

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size))
    try:
        import deepspeed

        from .cpu_compat import apply_cpu_compat

        apply_cpu_compat()
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        # Plain pickle: tensors travel as bytes, not as shared memory that dies with this process.
        queue.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def launch(fn: Callable, world_size: int, *args: Any, timeout: float = 600) -> List[Any]:
    """``fn(*args)`` on every rank; returns the results by rank. A hang past ``timeout`` fails."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    procs = [
        context.Process(target=_worker, args=(rank, world_size, port, fn, args, queue), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: List[Any] = [None] * world_size
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        remove_shm_buffers(port)
    return results


def remove_shm_buffers(port: int, address: str = "127.0.0.1") -> None:
    """Delete the shared-memory buffers DeepSpeed's CPU all-reduce leaves behind (69 MB a rank, never
    unlinked in 0.19.8): without this, each launch leaks them until /dev/shm fills up."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{address}_{port}_*"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def run_script(script: str, num_ranks: int = 2, timeout: float = 600,
               cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus num_ranks script`` (CPU ranks), its output captured; its shared-memory buffers
    removed whatever happens."""
    port = free_port()
    try:
        return subprocess.run(["deepspeed", "--num_gpus", str(num_ranks), "--master_port", str(port), script],
                              capture_output=True, text=True, timeout=timeout, cwd=cwd)
    finally:
        remove_shm_buffers(port)
