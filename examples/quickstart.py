import deepspeed
import torch

import deepspeed_patch

deepspeed_patch.install()  # not needed once the upstream patch is in DeepSpeed

model = torch.nn.Sequential()
model.add_module("embed", torch.nn.Linear(16, 32))
model.add_module("layers", torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)]))
model.add_module("head", torch.nn.Linear(32, 1))

ds_config = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "layer_grad_norms": {"enabled": True, "layers": "0,1,mid,-2,-1", "interval": 1},
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

for _ in range(3):
    x = torch.randn(4, 16)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()

stats = engine.get_layer_grad_norms()  # the same on every rank: a dict, or None (docs/reference.md)
if engine.global_rank == 0 and stats is None:
    print("no per-layer statistics: the layer_grad_norms block is missing or disabled, or no step was measured")
elif engine.global_rank == 0:
    print("step", stats["step"], "clip_coef", round(stats["clip_coef"], 3))
    for key, layer in stats["pre_clip"].items():
        print(f"{key!s:>6}  norm {layer['norm']:.3e}  min {layer['min']:+.3e}  max {layer['max']:+.3e}")

engine.destroy()
deepspeed.comm.destroy_process_group()  # the communication backend released before exit
