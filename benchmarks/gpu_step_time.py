"""Step-time cost of the per-layer statistics on one accelerator: a GPT of about 300M parameters, bf16,
ZeRO-1 and ZeRO-2, one rank.

    python benchmarks/gpu_step_time.py [--quick] [--device cuda|cpu] [--out DIR]

One engine per ZeRO stage with ``layer_grad_norms`` at ``interval: 2``, so measured and unmeasured steps
alternate; each step starts and ends with the accelerator idle (``synchronize``). Two figures per stage:

- the step-time ratio: each measured step against the mean of its two unmeasured neighbours;
- the time inside the call sites (``step_time.time_call_sites``) on measured steps, as a share of the
  median unmeasured step, in a second series of steps that waits for the accelerator before each call
  site, so that each call site is charged its own work only.

``--device cpu`` runs the same code on a 2-layer model on the host (the dry run of
``benchmarks/gpu_check.sh``).
"""

import argparse
import os
import statistics
import time
from typing import Dict, List, Tuple

import torch
from common import RESULTS, paired_ratios, percent, spread, write_results
from step_time import Spec, model_config, time_call_sites

from megatron_integration.cpu_launch import free_port, remove_shm_buffers
from megatron_integration.tiny_gpt import TinyGPT, synthetic_batch


def engine_for(spec: Spec):
    import deepspeed

    torch.manual_seed(0)
    model = TinyGPT(model_config(spec))
    ds_config = {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": spec.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "layer_grad_norms": {"enabled": True, "interval": 2},
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine


def measure(spec: Spec, inside: List[float], syncing: List[bool]) -> Dict[str, list]:
    """Per-step ``(measured, seconds)`` for the ratio, then ``(measured, seconds inside)`` for the share."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    engine = engine_for(spec)
    config = model_config(spec)

    def step(index: int) -> Tuple[bool, float, float]:
        batch = synthetic_batch(config, spec.micro_batch, seed=index).to(engine.device)
        accelerator.synchronize()
        inside_before, start = inside[0], time.perf_counter()
        engine.backward(engine(batch))
        engine.step()
        accelerator.synchronize()
        seconds = time.perf_counter() - start
        result = engine.get_layer_grad_norms()
        return result is not None and result["step"] == engine.global_steps, seconds, inside[0] - inside_before

    for index in range(4):  # warm-up (kernels compiled, allocator settled); an even number of steps
        step(index)
    steps = [step(index) for index in range(spec.steps)]
    syncing[0] = True
    shares = [step(index) for index in range(spec.steps)]
    syncing[0] = False
    engine.destroy()
    return {"steps": [(measured, seconds) for measured, seconds, _ in steps],
            "inside": [(measured, seconds) for measured, _, seconds in shares]}


def run(quick: bool, device: str) -> Tuple[List[str], dict]:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    import deepspeed_patch

    syncing = [False]
    inside = time_call_sites(lambda: syncing[0] and get_accelerator().synchronize())
    deepspeed_patch.install()
    port = free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                      LOCAL_SIZE="1")
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), verbose=False)
    layers, hidden, steps = (2, 64, 6) if device == "cpu" else (24, 1024, 20 if quick else 40)
    where = torch.cuda.get_device_name() if device == "cuda" else "host (dry run)"
    data = {"device": where, "rows": []}
    lines = [
        "# Step-time cost of the per-layer statistics on one accelerator", "", f"Device: {where}; torch "
        f"{torch.__version__}, DeepSpeed {deepspeed.__version__}, {get_accelerator().communication_backend_name()}.",
        "", f"{layers} layers, hidden {hidden}, micro-batch 8 of 64 tokens, bf16, AdamW, gradient clipping 1.0, "
        "one rank; `layer_grad_norms` at `interval: 2` (all layers, pre and post clip). Step-time ratio: each "
        "measured step over the mean of its unmeasured neighbours, median (IQR, count). Inside the call sites: "
        "the time spent in the functions DeepSpeed calls on measured steps, waiting for the accelerator before "
        "each, over the median unmeasured step.", "",
        "| ZeRO | params | unmeasured step | measured step, ratio | inside the call sites, measured steps |",
        "| --- | --- | --- | --- | --- |"
    ]
    for stage in (1, 2):
        spec = Spec(layers, hidden, stage, steps, micro_batch=8)
        timings = measure(spec, inside, syncing)
        step_seconds = statistics.median(seconds for measured, seconds in timings["steps"] if not measured)
        ratio = spread(paired_ratios(timings["steps"]))
        share = spread([seconds / step_seconds for measured, seconds in timings["inside"] if measured])
        params = sum(param.numel() for param in TinyGPT(model_config(spec)).parameters())
        data["rows"].append({"zero": stage, "params": params, "step_seconds": step_seconds, "ratio": ratio,
                             "inside_share": share})
        lines.append(f"| {stage} | {params / 1e6:.1f}M | {step_seconds * 1e3:.1f} ms | {percent(ratio)} "
                     f"| {share['median'] * 100:.2f}% ({share['q1'] * 100:.2f}-{share['q3'] * 100:.2f}) |")
        print(lines[-1], flush=True)
    remove_shm_buffers(port)  # DeepSpeed's host all-reduce leaves them behind
    return lines, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default=os.path.join(RESULTS, "gpu"), help="folder of step_time.{md,json}")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", args.device)
    write_results("step_time", *run(args.quick, args.device), folder=args.out)


if __name__ == "__main__":
    main()
