"""Reproduction: ZeRO-1/2 fp16 unscales the gradient with the loss scale already updated for the next step.

On a step where the dynamic loss scaler grows the scale, ``DeepSpeedZeroOptimizer.step`` calls
``_update_scale`` before ``unscale_and_clip_grads``, which divides by the new scale: the optimizer
consumes the gradient times old/new scale (half of it, with the default scale factor 2).

With SGD(lr=1) the update of the fp32 master weight is the gradient the optimizer consumed; the
expected one is the gradient of the (unscaled) loss, clipped as ``gradient_clipping`` asks. The
model is linear and the numbers are small integers, so without clipping everything is exact in fp16
and the ratio is exactly 1 or 0.5.

    python zero_unscale_after_scale_update.py [--stage 1|2] [--steps 6] [--gradient-clipping 0] [--json]

Runs on one CPU rank (gloo) or one GPU.
"""

import argparse
import json
import os
import socket

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_fp32_param

INITIAL_SCALE_POWER = 4  # 16: small, so the scale grows often without overflowing
SCALE_WINDOW = 2  # grow the scale after every 2 steps without overflow
INPUTS = torch.tensor([[1.0, 0.0, 2.0, 1.0], [0.0, 1.0, 1.0, 2.0]])


def init_one_rank() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if get_accelerator().device_name() == "cpu":  # the CPU accelerator refuses fp16 where oneDNN lacks it
        get_accelerator().is_fp16_supported = lambda: True
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())


def run(stage: int, steps: int, clipping: float) -> list:
    """One row per step: the loss scale the backward used, the scale after the step, the expected
    and the applied update of the weight, and their ratio."""
    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0, 3.0, 4.0]]) / 8)
    config = {
        "train_micro_batch_size_per_gpu": len(INPUTS),
        "zero_optimization": {"stage": stage},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": INITIAL_SCALE_POWER,
                 "loss_scale_window": SCALE_WINDOW, "hysteresis": 1},
        "gradient_clipping": clipping,  # DeepSpeed's default is 1.0
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                      config=config)
    inputs = INPUTS.to(engine.device).half()
    gradient = INPUTS.sum(dim=0)  # d(sum(x @ w)) / dw: the gradient of the loss below, exactly
    # what DeepSpeed's clipping makes of it: divided by (norm + 1e-6) / clipping when that is above 1
    expected = gradient / max(1.0, (gradient.norm().item() + 1e-6) / clipping) if clipping > 0 else gradient
    rows = []
    for step in range(1, steps + 1):
        scale_in_backward = float(engine.optimizer.loss_scale)
        loss = engine(inputs).float().sum()
        engine.backward(loss)
        before = safe_get_full_fp32_param(engine.module.weight).detach().cpu().clone()
        engine.step()
        applied = (before - safe_get_full_fp32_param(engine.module.weight).detach().cpu()).flatten()
        rows.append({
            "step": step,
            "loss_scale_in_backward": scale_in_backward,
            "loss_scale_after_step": float(engine.optimizer.loss_scale),
            "expected_update": expected.tolist(),
            "applied_update": applied.tolist(),
            "applied_over_expected": (applied / expected).tolist(),
        })
    engine.destroy()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, choices=(1, 2), default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--gradient-clipping", type=float, default=0.0, help="0: off (the gradient norm is 4.47)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    init_one_rank()
    rows = run(args.stage, args.steps, args.gradient_clipping)
    deepspeed.comm.destroy_process_group()
    if args.json:
        print(json.dumps({"deepspeed": deepspeed.__version__, "stage": args.stage, "rows": rows}))
        return
    print(f"DeepSpeed {deepspeed.__version__}, ZeRO-{args.stage}, fp16, gradient_clipping={args.gradient_clipping:g}, "
          "SGD(lr=1): update = consumed gradient")
    print(f"step  scale(backward) -> scale(after)  {'expected update':<32} {'applied update':<32} applied/expected")
    for row in rows:
        ratio = row["applied_over_expected"][0]
        flag = f"  <- scale grew {row['loss_scale_in_backward']:g} -> {row['loss_scale_after_step']:g}"
        flag = flag if abs(ratio - 1) > 1e-6 else ""
        expected, applied = ("[" + ", ".join(f"{value:.4g}" for value in row[key]) + "]"
                             for key in ("expected_update", "applied_update"))
        print(f"{row['step']:>4}  {row['loss_scale_in_backward']:>15g} -> {row['loss_scale_after_step']:<12g} "
              f"{expected:<32} {applied:<32} {ratio:.4g}{flag}")


if __name__ == "__main__":
    main()
