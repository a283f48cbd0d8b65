"""The Megatron-DeepSpeed side of layer-grad-norms.

- ``add_layer_grad_norms_args``, ``layer_grad_norms_ds_config``: the command-line flags and the
  ds_config block they fill.
- ``log_layer_grad_norms``: the call in the training loop (TensorBoard and the log line).
- ``tiny_gpt``: a small Megatron-style GPT (plain module and ``PipelineModule``) for tests and the demo.
- ``patches/``: the change to each Megatron-DeepSpeed fork.
"""

from .arguments import add_layer_grad_norms_args, layer_grad_norms_ds_config
from .training_log import log_layer_grad_norms

__all__ = ["add_layer_grad_norms_args", "layer_grad_norms_ds_config", "log_layer_grad_norms"]
