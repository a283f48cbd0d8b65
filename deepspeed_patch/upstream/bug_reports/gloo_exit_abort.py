"""Reproduction: a gloo process group left to the interpreter's exit can abort the process.

Each rank runs a few synchronous ``all_reduce`` of fresh CPU tensors and exits without
``destroy_process_group``, as most training scripts (and the Hugging Face Trainer) do. torch's gloo
worker thread (``ProcessGroupGloo::runLoop``) drops its reference to a finished work after the caller's
``wait`` has returned. When that is the last reference to a tensor Python created, freeing the tensor
frees its Python object (``TensorImpl::decref_pyobject``), which takes the GIL; if the interpreter is
finalizing by then, Python ends the thread with ``pthread_exit``, and the forced unwinding through a
``noexcept`` destructor calls ``std::terminate``: "terminate called without an active exception",
the rank dies of SIGABRT after its work finished correctly.

The race is narrow; each rank is pinned to one CPU (``os.sched_setaffinity``), which makes the worker
wait for the GIL more often, as a loaded machine does.

    python gloo_exit_abort.py [--runs 20] [--collectives 50] [--json]

Needs only torch (CPU, gloo); launches its 2 ranks itself.
"""

import argparse
import json
import os
import socket
import subprocess
import sys

MESSAGE = "terminate called without an active exception"


def rank_main(rank: int, port: int, collectives: int) -> None:
    import torch
    import torch.distributed as dist

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]})
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    for _ in range(collectives):
        dist.all_reduce(torch.ones(8, dtype=torch.float64))
    # no destroy_process_group(): the interpreter exits with the process group alive


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_run(collectives: int) -> dict:
    """Both ranks once: their return codes and whether they printed the abort."""
    port = free_port()
    command = [sys.executable, os.path.abspath(__file__), "--port", str(port), "--collectives", str(collectives)]
    ranks = [
        subprocess.Popen(command + ["--rank", str(rank)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for rank in range(2)
    ]
    errors = [rank.communicate(timeout=300)[1] for rank in ranks]
    return {"returncodes": [rank.returncode for rank in ranks], "terminate_called": [MESSAGE in e for e in errors]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--collectives", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.port, args.collectives)
        return
    import torch

    runs = [one_run(args.collectives) for _ in range(args.runs)]
    aborted = sum(any(code != 0 for code in run["returncodes"]) for run in runs)
    print(f"torch {torch.__version__}, gloo, 2 ranks, {args.collectives} all_reduce each, no destroy_process_group")
    for number, run in enumerate(runs, 1):
        print(f"run {number:3d}: rank return codes {run['returncodes']}, '{MESSAGE}': {run['terminate_called']}")
    print(f"{aborted} of {len(runs)} runs had a rank abort at exit")
    if args.json:
        print(json.dumps({"torch": torch.__version__, "runs": runs, "aborted": aborted}))


if __name__ == "__main__":
    main()
