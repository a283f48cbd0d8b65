"""Session-script shims that let the bigscience-workshop fork (8387ae17) train on CPU ranks.

Applied in each rank by ``bs_entry.py`` next to the harness's own shims (``megatron_integration.fork_e2e.shims``).
None touches a gradient value: each replaces an import the fork needs only for CUDA, or makes a CUDA-only
call act on the CPU. Not part of ``layer-grad-norms megatron-e2e`` (yet): run by hand with ``bs_run.sh``.
"""

import math
import os
import sys
import types

import numpy as np
import torch


def _fail(*_args, **_kwargs):
    raise RuntimeError("a CUDA-only apex kernel was called (stub in this run)")


def _stub_getattr(name):
    """Any public name of a stub module is ``_fail``; dunder names stay missing (``inspect`` walks modules)."""
    if name.startswith("__"):
        raise AttributeError(name)
    return _fail


def before_fork_import() -> None:
    """Imports the fork makes at module level: ``np.float`` (removed in numpy 1.24), ``torch._six.inf``
    (removed in torch 2.0), apex's FusedAdam / FusedSGD (torch's AdamW / SGD: apex's FusedAdam is AdamW by
    default), ``apex.multi_tensor_apply`` and ``amp_C`` (used only by Megatron's own optimizer and
    ``--log-params-norm``, not under DeepSpeed: they fail if called). CUDA calls become CPU ones."""
    np.float = float
    six = types.ModuleType("torch._six")
    six.inf = math.inf
    apex, optimizers, multi_tensor = (types.ModuleType(name) for name in
                                      ("apex", "apex.optimizers", "apex.multi_tensor_apply"))
    optimizers.FusedAdam, optimizers.FusedSGD = torch.optim.AdamW, torch.optim.SGD
    multi_tensor.multi_tensor_applier = _fail
    apex.optimizers, apex.multi_tensor_apply = optimizers, multi_tensor
    amp_c, layer_norm_cuda = types.ModuleType("amp_C"), types.ModuleType("fused_mix_prec_layer_norm_cuda")
    amp_c.__getattr__ = layer_norm_cuda.__getattr__ = _stub_getattr
    sys.modules.update({"torch._six": six, "apex": apex, "apex.optimizers": optimizers,
                        "apex.multi_tensor_apply": multi_tensor, "amp_C": amp_c,
                        "fused_mix_prec_layer_norm_cuda": layer_norm_cuda})
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.set_device = lambda *_args: None  # one function per name: torch._dynamo refuses one object under two
    cuda.synchronize = lambda *_args: None
    cuda.get_rng_state = lambda *_args: torch.get_rng_state()
    cuda.manual_seed = torch.manual_seed
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, lambda *_args: 0)
    cuda.FloatTensor, cuda.LongTensor, cuda.IntTensor = torch.FloatTensor, torch.LongTensor, torch.IntTensor
    torch.Tensor.cuda = lambda self, *_args, **_kwargs: self
    torch.nn.Module.cuda = lambda self, *_args, **_kwargs: self


def after_fork_import() -> None:
    """``megatron/initialize.py`` asserts ``torch.cuda.is_available()`` and sets up model parallelism only
    when ``torch.cuda.device_count() > 0``: that module (only) sees a CUDA that says yes, with one device
    per rank. The CUDA RNG tracker sets the CPU generator's state; the fused kernels are not built; the
    fork's ``MixedFusedLayerNorm`` takes its own ``F.layer_norm`` branch instead of the CUDA kernel."""
    import megatron.fused_kernels
    import megatron.initialize
    import megatron.mpu.random
    from megatron.model.fused_layer_norm import MixedFusedLayerNorm

    proxy = types.ModuleType("torch_with_cpu_cuda")
    proxy.__getattr__ = lambda name: getattr(torch, name)
    proxy.cuda = types.SimpleNamespace(is_available=lambda: True, set_device=lambda *_args: None,
                                       device_count=lambda: int(os.environ["WORLD_SIZE"]))
    megatron.initialize.torch = proxy
    megatron.mpu.random._set_cuda_rng_state = lambda state, device=-1: torch.set_rng_state(state)
    megatron.fused_kernels.load = lambda args: None
    init = MixedFusedLayerNorm.__init__

    def init_without_kernel(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.use_meg_ds_fused_layer_norm = False

    MixedFusedLayerNorm.__init__ = init_without_kernel
