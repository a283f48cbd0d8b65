"""What each rank of a fork run executes: ``python entry.py [--local_rank=N] FORK/pretrain_gpt.py ARGS...``.

Applies the CPU shims of ``shims.py`` in this process, then runs the fork's own training script as
``__main__`` with the fork's root first on ``sys.path``, as ``python pretrain_gpt.py ARGS...`` would.
Rank 0 prints the shims it applied and the class of each optimizer ``deepspeed.initialize`` returns, so
that the log says which DeepSpeed code path was measured (``BF16_Optimizer`` for the BLOOM set-up); and,
where the engine clips in fp32 without ZeRO, the reference norm of ``reference.py`` at each step.
"""

import functools
import os
import runpy
import sys

from megatron_integration.fork_e2e import shims
from megatron_integration.fork_e2e.reference import report_reference_norm

SHIMS_LINE = "[fork_e2e] shims applied:"
OPTIMIZER_LINE = "[fork_e2e] deepspeed.initialize returned optimizer:"


def report_optimizer(initialize):
    """``deepspeed.initialize`` that prints, on rank 0, the class of the optimizer it returns, and makes the
    engine report the reference norm (printed only by an engine that clips in fp32 without ZeRO)."""

    @functools.wraps(initialize)
    def initialize_reporting_optimizer(*args, **kwargs):
        engine, optimizer, *rest = initialize(*args, **kwargs)
        if _rank_zero():
            print(OPTIMIZER_LINE, type(optimizer).__name__, flush=True)
        report_reference_norm(engine)
        return (engine, optimizer, *rest)

    return initialize_reporting_optimizer


def _rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def main() -> None:
    launcher_args = [arg for arg in sys.argv[1:] if arg.startswith("--local_rank")]  # the launcher puts it first
    script, *fork_args = [arg for arg in sys.argv[1:] if arg not in launcher_args]
    script = os.path.abspath(script)
    sys.path.insert(0, os.path.dirname(script))
    sys.argv = [script] + fork_args + launcher_args
    for shim in shims.BEFORE_FORK_IMPORT + shims.AFTER_FORK_IMPORT:
        shim()
    if _rank_zero():
        print(SHIMS_LINE, "; ".join(shims.APPLIED) or "none", flush=True)
    import deepspeed

    deepspeed.initialize = report_optimizer(deepspeed.initialize)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
