"""The Megatron-DeepSpeed side of layer-grad-norms.

- ``add_layer_grad_norms_args``, ``layer_grad_norms_ds_config``: the command-line flags and the
  ds_config block they fill.
- ``log_layer_grad_norms``: the call in the training loop (TensorBoard and the log line).
- ``tiny_gpt``: a small Megatron-style GPT (plain module and ``PipelineModule``) for tests and the demo.
- ``patches/``: the change to each Megatron-DeepSpeed fork.

The names are imported on first use, so that ``megatron_integration.tiny_gpt`` alone does not import
``deepspeed_patch`` (the upstream patch is tested without it).
"""

import importlib

_EXPORTS = {
    "add_layer_grad_norms_args": "arguments",
    "layer_grad_norms_ds_config": "arguments",
    "log_layer_grad_norms": "training_log",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
