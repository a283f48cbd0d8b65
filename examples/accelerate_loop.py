"""Per-layer gradient statistics in a Hugging Face Accelerate loop under DeepSpeed ZeRO-2.

Run as written on 2 CPU ranks with ``deepspeed --num_gpus 2 examples/accelerate_loop.py`` (or
``accelerate launch`` with the same ranks). ``accelerator.backward`` runs DeepSpeed's backward and, on the
step that completes the accumulation, its optimizer step, where the statistics are measured; read them
from the engine (the prepared model) after ``optimizer.step()``.
"""

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin

import deepspeed_patch

deepspeed_patch.install()  # before accelerator.prepare, which calls deepspeed.initialize

ds_config = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
    "layer_grad_norms": {"enabled": True, "layers": "all"},
}
accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config))

torch.manual_seed(0)
model = torch.nn.Sequential()
model.add_module("embed", torch.nn.Linear(16, 32))
model.add_module("layers", torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)]))
model.add_module("head", torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
engine, optimizer = accelerator.prepare(model, optimizer)  # the model comes back as the DeepSpeed engine

last_step = None
for _ in range(3):
    loss = engine(torch.randn(4, 16)).pow(2).mean()
    accelerator.backward(loss)  # DeepSpeed's backward, and its optimizer step
    optimizer.step()  # a no-op under DeepSpeed: the engine has stepped
    optimizer.zero_grad()
    # The last measured step's statistics, the same on every rank (None before the first step); with
    # accumulation, a new "step" marks an optimizer step.
    stats = engine.get_layer_grad_norms()
    if stats is not None and stats["step"] != last_step and engine.global_rank == 0:
        total = sum(bucket["norm"]**2 for bucket in stats["pre_clip"].values())**0.5
        print(f"step {stats['step']} grad_norm {engine.get_global_grad_norm():.6f} "
              f"root-sum-square {total:.6f} clip_coef {stats['clip_coef']:.3f}")
        print("  " + "  ".join(f"{key}: {bucket['norm']:.3e}" for key, bucket in stats["pre_clip"].items()))
    last_step = None if stats is None else stats["step"]

engine.destroy()
accelerator.end_training()  # destroys the process group: after the engine
