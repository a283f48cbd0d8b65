"""Reproduction: without ZeRO, fp16 training applies the gradient divided by a loss scale the loss never carried.

``DeepSpeedEngine.backward`` multiplies the loss by the loss scale only for ZeRO optimizers
(``isinstance(self.optimizer, ZeROOptimizer)``), yet ``FP16_UnfusedOptimizer`` and ``FP16_Optimizer``,
which DeepSpeed uses for fp16 with ZeRO stage 0, still divide the gradient by their loss scale in
``unscale_and_clip_grads``, and their gradient norm (``get_global_grad_norm``, gradient clipping) by
it as well.

With SGD(lr=1) the update of the weight is the gradient the optimizer consumed; the expected one is
the gradient of the loss. The model is linear and the numbers are small integers, so the gradient is
exact in every dtype.

    python stage0_unscaled_loss.py [--dtype fp16|bf16] [--steps 3] [--json]

Runs on one CPU rank (gloo) or one GPU.
"""

import argparse
import json
import os
import socket

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

INITIAL_SCALE_POWER = 8  # loss scale 256 at the start
INPUTS = torch.tensor([[1.0, 0.0, 2.0, 1.0], [0.0, 1.0, 1.0, 2.0]])
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def start_one_rank_group() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free_port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port))
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":  # the CPU accelerator refuses fp16 where oneDNN lacks it
        accelerator.is_fp16_supported = lambda: True
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name())


def train(dtype: str, steps: int) -> list:
    """One row per step: the optimizer's loss scale, the expected and the applied update of the
    weight, their ratio, and the gradient norm the engine reports against the true one."""
    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0, 3.0, 4.0]]) / 8)
    precision = {"enabled": True}
    if dtype == "fp16":
        precision.update(loss_scale=0, initial_scale_power=INITIAL_SCALE_POWER)
    config = {"train_micro_batch_size_per_gpu": len(INPUTS), dtype: precision, "gradient_clipping": 0.0}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                      config=config)
    expected = INPUTS.sum(dim=0)  # d(sum(x @ w)) / dw: the gradient of the loss below, exactly
    rows = []
    for step in range(1, steps + 1):
        before = engine.module.weight.detach().float().cpu().clone()
        loss_scale = float(engine.optimizer.loss_scale_config.cur_scale)
        engine.backward(engine(INPUTS.to(engine.device, DTYPES[dtype])).float().sum())
        engine.step()
        applied = (before - engine.module.weight.detach().float().cpu()).flatten()
        rows.append({
            "step": step,
            "optimizer": type(engine.optimizer).__name__,
            "loss_scale": loss_scale,
            "expected_update": expected.tolist(),
            "applied_update": applied.tolist(),
            "applied_over_expected": (applied / expected).tolist(),
            "reported_grad_norm": float(engine.get_global_grad_norm()),
            "true_grad_norm": float(expected.norm()),
        })
    engine.destroy()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    start_one_rank_group()
    rows = train(args.dtype, args.steps)
    deepspeed.comm.destroy_process_group()
    if args.json:
        print(json.dumps({"deepspeed": deepspeed.__version__, "dtype": args.dtype, "rows": rows}))
        return
    print(f"DeepSpeed {deepspeed.__version__}, ZeRO stage 0, {args.dtype}, {rows[0]['optimizer']}, SGD(lr=1)")
    print("step  loss scale  expected update       applied update             applied/expected  grad norm: "
          "reported / true")
    for row in rows:
        applied = "[" + ", ".join(f"{value:.6g}" for value in row["applied_update"]) + "]"
        norms = f"{row['reported_grad_norm']:.6g} / {row['true_grad_norm']:.6g}"
        print(f"{row['step']:>4}  {row['loss_scale']:>10g}  {str(row['expected_update']):<21} {applied:<26} "
              f"{row['applied_over_expected'][0]:<17.6g} {norms}")


if __name__ == "__main__":
    main()
