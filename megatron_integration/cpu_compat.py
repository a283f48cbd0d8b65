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

from deepspeed_patch import capabilities


def apply_cpu_compat() -> List[str]:
    """Apply the work-arounds the installed DeepSpeed needs on CPU (``capabilities``); returns their names."""
    applied = []
    if capabilities.installed().cpu_all_gather_needs_no_grad:
        _all_gather_without_autograd()
        applied.append("all_gather_into_tensor under no_grad")
    return applied


def _all_gather_without_autograd() -> None:
    """ZeRO-1/2's parameter all-gather fails on CPU: "RuntimeError: Output 0 of Split is a view and is being
    modified inplace" from TorchBackend.all_gather_into_tensor (deepspeed/comm/torch.py), which autograd
    records because the gather runs with gradients enabled. Under torch.no_grad() it runs, with the same
    values."""
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
