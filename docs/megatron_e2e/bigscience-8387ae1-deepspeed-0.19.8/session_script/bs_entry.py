"""Each rank of the bigscience run: ``python bs_entry.py [--local_rank=N] FORK/pretrain_gpt.py ARGS...``.

Like ``megatron_integration/fork_e2e/entry.py``, plus ``bs_shims.py``; ``deepspeed.initialize`` is called
by this fork with both ``config=`` (the loaded ds_config) and ``args.deepspeed_config`` (its path), which
DeepSpeed 0.14+ refuses; the same contents, so ``args.deepspeed_config`` is cleared when ``config`` is
given. The fork's TensorBoard writer is closed at the end (the fork never closes it).
"""

import functools
import os
import runpy
import sys

import bs_shims

from megatron_integration.fork_e2e import shims
from megatron_integration.fork_e2e.entry import SHIMS_LINE, report_optimizer


def config_once(initialize):
    @functools.wraps(initialize)
    def initialize_with_config_once(*args, **kwargs):
        if kwargs.get("config") is not None and getattr(kwargs.get("args"), "deepspeed_config", None):
            kwargs["args"].deepspeed_config = None
        return initialize(*args, **kwargs)

    return initialize_with_config_once


def main() -> None:
    launcher_args = [arg for arg in sys.argv[1:] if arg.startswith("--local_rank")]
    script, *fork_args = [arg for arg in sys.argv[1:] if arg not in launcher_args]
    script = os.path.abspath(script)
    sys.path.insert(0, os.path.dirname(script))
    sys.argv = [script] + fork_args + launcher_args
    bs_shims.before_fork_import()
    for shim in shims.BEFORE_FORK_IMPORT:
        shim()
    bs_shims.after_fork_import()
    for shim in shims.AFTER_FORK_IMPORT:
        shim()
    print(SHIMS_LINE, "; ".join(shims.APPLIED), flush=True)
    import deepspeed

    deepspeed.initialize = report_optimizer(config_once(deepspeed.initialize))
    runpy.run_path(script, run_name="__main__")
    writer = getattr(sys.modules.get("megatron.global_vars"), "_GLOBAL_TENSORBOARD_WRITER", None)
    if writer is not None:
        writer.close()


if __name__ == "__main__":
    main()
