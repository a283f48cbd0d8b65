"""Work-arounds for DeepSpeed bugs that stop a release from running on CPU with torch 2.13, for the test
harnesses and the CPU demo only.

Each is applied only to the releases that need it, changes no value, and stays out of the measured path:
``deepspeed_patch.install()`` never applies them. A CPU user of such a release needs the same
work-around (or a DeepSpeed that fixed it), whether or not this package is installed.
"""

import functools
import importlib
from typing import List

import torch
from packaging.version import Version

# ZeRO-1/2's parameter all-gather fails on CPU: "RuntimeError: Output 0 of Split is a view and is being
# modified inplace" from TorchBackend.all_gather_into_tensor (deepspeed/comm/torch.py), which autograd
# records because the gather runs with gradients enabled. Under torch.no_grad() it runs, with the same values.
ALL_GATHER_NO_GRAD_RELEASES = ("0.18", "0.19")  # from, up to but not including


def apply_cpu_compat() -> List[str]:
    """Apply the work-arounds the installed DeepSpeed needs on CPU; returns their names."""
    import deepspeed

    release = Version(Version(deepspeed.__version__).base_version)
    applied = []
    if Version(ALL_GATHER_NO_GRAD_RELEASES[0]) <= release < Version(ALL_GATHER_NO_GRAD_RELEASES[1]):
        _all_gather_without_autograd()
        applied.append("all_gather_into_tensor under no_grad")
    return applied


def _all_gather_without_autograd() -> None:
    backend = importlib.import_module("deepspeed.comm.torch").TorchBackend  # deepspeed.comm.torch is torch
    original = backend.all_gather_into_tensor
    if getattr(original, "_cpu_compat", False):
        return

    @functools.wraps(original)
    def all_gather_into_tensor(self, *args, **kwargs):
        with torch.no_grad():
            return original(self, *args, **kwargs)

    all_gather_into_tensor._cpu_compat = True
    backend.all_gather_into_tensor = all_gather_into_tensor
