"""Run-time shims that let a Megatron-DeepSpeed fork train on CPU ranks, applied by ``entry.py`` in each rank.

None of them touches a gradient value: each changes an import, a memory layout, a keyword argument, the
autograd recording of a collective whose result is only ever copied, or what the fork prints. Each is
applied only where its target exists and still has the problem, and says so on stdout (rank 0), so the
log of a run names the shims it needed. The fork's own files are never changed.
"""

import functools
import importlib
import importlib.machinery
import importlib.util
import sys
import types
from typing import Callable, List, Optional

import torch

APPLIED: List[str] = []
"""The names of the shims applied in this process, in order."""


def _applied(name: str) -> None:
    APPLIED.append(name)


def stub_torchvision() -> None:
    """``megatron/training.py`` imports ``megatron.model.vision.knn_monitor``, which imports torchvision at
    module level (``megatron/data/vit_dataset.py``, ``megatron/data/image_folder.py``) for the vision
    models only. No torchvision wheel matches a CPU torch 2.13 build, so an empty module stands in: GPT
    training never calls it, and any call fails loudly."""
    if _importable("torchvision"):
        return
    unavailable = _failing("torchvision is a stub in this run (megatron_integration.fork_e2e.shims)")

    class VisionDataset:  # a base class at module level in image_folder.py
        def __init__(self, *_args, **_kwargs):
            unavailable()

    root, transforms, datasets = (_stub_module(name)
                                  for name in ("torchvision", "torchvision.transforms", "torchvision.datasets"))
    datasets.VisionDataset = VisionDataset
    datasets.ImageFolder = VisionDataset
    transforms.__getattr__ = datasets.__getattr__ = functools.partial(_stand_in, unavailable)
    root.transforms, root.datasets, root.get_image_backend = transforms, datasets, unavailable
    sys.modules.update({"torchvision": root, "torchvision.transforms": transforms, "torchvision.datasets": datasets})
    _applied("stub torchvision")


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def _failing(message: str) -> Callable:
    """A function that raises ``RuntimeError(message)`` whatever it is called with."""

    def fail(*_args, **_kwargs):
        raise RuntimeError(message)

    return fail


def _stand_in(function: Callable, name: str) -> Callable:
    """A stub module's ``__getattr__``: ``function`` for any public name (``T.Compose``, ...)."""
    if name.startswith("__"):
        raise AttributeError(name)
    return function


def _stub_module(name: str) -> types.ModuleType:
    """An empty module with a spec, so that ``importlib.util.find_spec`` (transformers asks) accepts it."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, origin="megatron_integration stub")
    return module


def stub_compression() -> None:
    """DeepSpeed 0.19 removed its compression library and leaves ``deepspeed.compression`` as an empty
    package, but ``megatron/training.py`` imports ``init_compression`` and ``redundancy_clean`` from
    ``deepspeed.compression.compress`` at module level; they are called only with
    ``--compression-training``. Stand-ins that fail when called let the import succeed."""
    if _importable("deepspeed.compression.compress"):
        return
    module = _stub_module("deepspeed.compression.compress")
    module.init_compression = module.redundancy_clean = _failing(
        "deepspeed.compression was removed in DeepSpeed 0.19: --compression-training cannot run")
    sys.modules["deepspeed.compression.compress"] = module
    _applied("stub deepspeed.compression.compress")


def cpu_compat() -> None:
    """DeepSpeed's own CPU work-arounds for the installed release (``megatron_integration.cpu_compat``):
    the same ones the package's tests and demo apply."""
    from ..cpu_compat import apply_cpu_compat

    for name in apply_cpu_compat():
        _applied(name)


def contiguous_attention_inputs() -> None:
    """``CoreAttention.forward`` ``.view``s query, key and value from ``[sq, b, np, hn]`` to ``[sq, b * np, hn]``;
    ``ParallelAttention`` slices them out of the fused ``[sq, b, 3h]`` projection
    (``mixed_x_layer[:, :, :each_hidden_size].reshape(...)``), so with a micro batch above 1 the batch and
    head dimensions cannot be merged by a view ("view size is not compatible with input tensor's size and
    stride"). ``.contiguous()`` copies them into the layout ``.view`` needs: same values, and autograd
    routes the gradient back unchanged."""
    attention = getattr(_fork_module("megatron.model.transformer"), "CoreAttention", None)
    if attention is None:
        return
    forward = attention.forward

    @functools.wraps(forward)
    def contiguous_forward(self, query_layer, key_layer, value_layer, attention_mask):
        return forward(self, query_layer.contiguous(), key_layer.contiguous(), value_layer.contiguous(),
                       attention_mask)

    attention.forward = contiguous_forward
    _applied("contiguous q/k/v for CoreAttention.forward")


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` that accepts and ignores ``sequence_parallel=`` (always false on CPU). Named
    ``LayerNorm`` because a pipeline spec's class name is its bucket's label (``.../LayerNorm``)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, sequence_parallel: bool = False, **kwargs) -> None:
        super().__init__(normalized_shape, eps=eps, **kwargs)


def layer_norm_accepting_sequence_parallel() -> None:
    """Before commit 4efb479 (#468), ``megatron.model`` binds ``LayerNorm`` to ``torch.nn.LayerNorm`` on
    non-CUDA devices, yet ``GPTModelPipe`` builds its final norm with ``sequence_parallel=``, which
    ``torch.nn.LayerNorm`` rejects. The fork's later ``SPLayerNorm`` fixes it the same way: the same
    module, the keyword dropped."""
    gpt_model = _fork_module("megatron.model.gpt_model")
    if getattr(gpt_model, "LayerNorm", None) is not torch.nn.LayerNorm:
        return
    gpt_model.LayerNorm = LayerNorm
    _applied("LayerNorm accepting sequence_parallel= for GPTModelPipe")


def _fork_module(name: str) -> Optional[types.ModuleType]:
    """The fork's module, or ``None`` for a fork without it (nothing to shim); its import errors propagate."""
    return importlib.import_module(name) if importlib.util.find_spec(name) is not None else None


def report_grad_norm_without_pipeline() -> None:
    """The fork's non-pipeline DeepSpeed path (``train_step``, ZeRO without ``PipelineEngine``) returns
    ``grad_norm = None``, so its log line and TensorBoard carry no grad norm; its pipeline path returns
    ``model[0].get_global_grad_norm()``. This makes the non-pipeline path return the same call, so that
    every set-up's log shows the norm the per-layer norms are checked against. It reads a number
    DeepSpeed has already computed: no collective, no change to the step."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    training = _fork_module("megatron.training")
    train_step = getattr(training, "train_step", None)
    if train_step is None:
        return

    @functools.wraps(train_step)
    def train_step_reporting_grad_norm(forward_step_func, data_iterator, model, *args, **kwargs):
        loss, skipped, grad_norm, num_zeros = train_step(forward_step_func, data_iterator, model, *args, **kwargs)
        if grad_norm is None and isinstance(model[0], DeepSpeedEngine):
            grad_norm = model[0].get_global_grad_norm()
        return loss, skipped, grad_norm, num_zeros

    training.train_step = train_step_reporting_grad_norm
    _applied("grad norm reported on the non-pipeline path")


BEFORE_FORK_IMPORT = (stub_torchvision, stub_compression, cpu_compat)
AFTER_FORK_IMPORT = (contiguous_attention_inputs, layer_norm_accepting_sequence_parallel,
                     report_grad_norm_without_pipeline)
