# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The host kernels of the fused statistics (``csrc/partition_stats.cpp``), compiled on first use: a gradient
partition's, and an fp32 master partition's with its Adam moments and update (``optimizer_stats``).

``_load`` builds it with the system's C++ compiler (``torch.utils.cpp_extension``) into the user's torch
extensions cache (``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``), about ten seconds, once
per source, flags and torch version: later processes load the cached library. Ranks of one machine that
ask at the same time wait for the first one's build (``cpp_extension`` locks the build directory).
The library holds AVX-512, AVX2 and baseline x86-64 versions of the loop and picks one when it is
loaded, so a cache shared by machines of different kinds stays safe (no ``-march=native``).
"""

import functools
import logging
import os
import re
import time
from typing import Callable, Optional

import torch
from deepspeed.utils import logger
from deepspeed.utils.logging import log_dist

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "partition_stats.cpp")
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno"]  # errno-free sqrt: the Adam update vectorises
LDFLAGS = ["-fopenmp"]
# A build another process has under way holds a lock file in the build directory, which torch waits for
# without limit; a build that was killed leaves it behind. Wait this long for it, at most, then use the
# stock operators: the statistics must never stall the start of a training run.
BUILD_WAIT_SECONDS = 300


def extension_name() -> str:
    """The cache entry's name; it carries torch's version, whose ABI the library is built against."""
    return "layer_grad_norms_partition_stats_torch" + re.sub(r"[^0-9A-Za-z]", "_", torch.__version__)


@functools.lru_cache(maxsize=None)
def host_kernel() -> Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], None]]:
    """The op ``accumulate_chunks(stats, flat, chunks, extra)``, or None when it cannot be built.

    A missing compiler or a failed build is logged once per process; callers then use the stock
    operators of ``partition_stats.accumulate_spans``.
    """
    from torch.utils import cpp_extension

    loaded = getattr(torch.ops.layer_grad_norms, "accumulate_chunks", None)
    if loaded is not None:  # loaded by another copy of this module: a second registration would abort the process
        return loaded
    lock = os.path.join(cpp_extension._get_build_directory(extension_name(), verbose=False), "lock")
    if not _unlocked(lock, BUILD_WAIT_SECONDS):
        logger.warning(
            "layer_grad_norms: the fused statistics kernel's build directory is locked (%s; a build that "
            "was interrupted leaves it behind: remove it); using stock PyTorch operators instead", lock)
        return None
    _announce_build(os.path.dirname(lock))
    try:
        _load()
        return torch.ops.layer_grad_norms.accumulate_chunks
    except Exception as error:  # no compiler, no ninja, a failed build or load: the stock path still works
        logger.warning(
            "layer_grad_norms: the fused statistics kernel for the host could not be built (%s: %s); "
            "using stock PyTorch operators instead (slower, same results)",
            type(error).__name__,
            str(error).strip().splitlines()[-1] if str(error).strip() else "")
        return None


def _load() -> None:
    """Build the library, or find it in the cache, and load it: loading registers its ops."""
    from torch.utils import cpp_extension

    cpp_extension.load(name=extension_name(),
                       sources=[SOURCE],
                       extra_cflags=CFLAGS,
                       extra_ldflags=LDFLAGS,
                       is_python_module=False,
                       verbose=False)


def host_adam_kernel() -> Optional[Callable[..., None]]:
    """The op ``accumulate_adam_chunks(stats, param, exp_avg, exp_avg_sq, chunks, rule, kinds)`` of the same
    library (``optimizer_stats``: the weights, the update and the moments in one read), or None."""
    return None if host_kernel() is None else torch.ops.layer_grad_norms.accumulate_adam_chunks


def _announce_build(build_dir: str) -> None:
    """One line, from rank 0, before a build that is not cached yet: the silence would last half a minute. At
    WARNING: DeepSpeed's logger shows nothing below it by default (0.19)."""
    library = os.path.join(build_dir, f"{extension_name()}.so")
    if os.path.exists(library) and os.path.getmtime(library) >= os.path.getmtime(SOURCE):
        return
    log_dist(
        "layer_grad_norms: building the fused statistics kernel for the host (C++/OpenMP, "
        f"csrc/partition_stats.cpp) into {build_dir}, once per torch version: about 20 to 30 s",
        ranks=[0],
        level=logging.WARNING)


def _unlocked(lock: str, seconds: float) -> bool:
    """Whether ``lock`` is gone, or goes within ``seconds`` (a lock older than that is stale at once)."""
    deadline = time.monotonic() + seconds
    while os.path.exists(lock):
        try:
            if time.time() - os.path.getmtime(lock) > seconds or time.monotonic() > deadline:
                return False
        except OSError:  # removed meanwhile
            break
        time.sleep(0.5)
    return True
