"""Which granularity ``adaptive_clipping`` should default to: per layer (the statistics' buckets) or per tensor (the
one AdaGC's defaults, factor 1.05 and beta 0.98, were tuned for), measured on a gradient outlier, AdaGC's design case.

    python benchmarks/adagc_granularity.py [--seeds 0 1 2] [--steps 150] [--warmup 50] [--outlier-step 120]

The demo's tiny Pre-LN GPT (4 layers, hidden 64) in plain PyTorch with AdamW (lr 1e-3) on the demo's synthetic
batches, once per granularity, from the same weights on the same batches; each step's gradient is clipped by
``deepspeed_patch.remedies.adaptive_clipping.AdaptiveClipping`` (the package's own rule, fed the step's per-bucket
norms; global clipping at 1.0 in the warm-up) before AdamW. At ``--outlier-step`` one tensor's gradient is
multiplied by ``OUTLIER`` (a gradient outlier: one bad batch's gradient in one tensor), once a small tensor (a layer
norm's weight) and once a large one (the MLP's first weight), each in its own run. Measured per granularity:

- how much of the outlier got through: the tensor's clipped gradient norm at the outlier step over its norm the
  step before (``OUTLIER`` where nothing is clipped, about ``factor`` = 1.05 where AdaGC holds it at its average);
- on the clean steps after the warm-up: the share of buckets clipped per step and the median factor of those
  clipped (what AdaGC's thresholds do where nothing is wrong).

Writes ``benchmarks/results/adagc_granularity.{md,json}``.
"""

import argparse
import json
import math
import os
import statistics
import sys
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepspeed_patch.config import AdaptiveClippingConfig  # noqa: E402
from deepspeed_patch.remedies.adaptive_clipping import AdaptiveClipping  # noqa: E402
from megatron_integration.tiny_gpt import TinyGPT, TinyGPTConfig, synthetic_batch  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODEL = TinyGPTConfig(vocab_size=256, seq_len=32, hidden=64, num_layers=4, num_heads=4)
MICRO_BATCH = 8
OUTLIER = 100.0
TARGETS = {"small tensor": "layers.2.post_attention_layernorm.weight", "large tensor": "layers.2.dense_h_to_4h.weight"}
GRANULARITIES = ("layer", "param")


def bucket_of(name: str, granularity: str) -> str:
    """The documented bucket of a parameter: its layer (``layers.N``, else its module) or itself."""
    if granularity == "param":
        return name
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else ".".join(parts[:-1]) or name


def run(seed: int, granularity: str, target: str, args: argparse.Namespace) -> Dict:
    """One training run; returns the outlier's pass-through and the clean steps' clipping."""
    torch.manual_seed(seed)
    model = TinyGPT(MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    named = list(model.named_parameters())
    keys = list(dict.fromkeys(bucket_of(name, granularity) for name, _ in named))
    row = torch.tensor([keys.index(bucket_of(name, granularity)) for name, _ in named])
    clipping = AdaptiveClipping(AdaptiveClippingConfig(enabled=True, warmup_steps=args.warmup), keys)
    shares, factors_below, before = [], [], math.nan
    passed = math.nan
    for step in range(1, args.steps + 1):
        optimizer.zero_grad()
        model(synthetic_batch(MODEL, MICRO_BATCH, seed=1000 * seed + step)).backward()
        grads = dict((name, param.grad) for name, param in named)
        if step == args.outlier_step:
            grads[target].mul_(OUTLIER)
        norms = torch.zeros(len(keys), dtype=torch.float64).index_add_(
            0, row, torch.stack([grad.double().norm()**2 for grad in grads.values()])).sqrt()
        factors = clipping.factors(norms)
        applied = factors if factors is not None else torch.full_like(norms, min(1.0, 1.0 / (norms.norm() + 1e-6)))
        clipping.update(norms * applied)
        for index, grad in enumerate(grads.values()):
            grad.mul_(float(applied[row[index]]))
        target_norm = grads[target].norm().item()
        if step == args.outlier_step - 1:
            before = target_norm
        elif step == args.outlier_step:
            passed = target_norm / before
        elif factors is not None:
            clipped = factors < 1
            shares.append(clipped.double().mean().item())
            factors_below.extend(factors[clipped].tolist())
        optimizer.step()
    return {"passed": passed, "clipped_share": statistics.mean(shares),
            "median_factor": statistics.median(factors_below) if factors_below else 1.0, "buckets": len(keys)}


def median_range(values: List[float]) -> str:
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--outlier-step", type=int, default=120)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = {f"{granularity}, {kind}": [run(seed, granularity, target, args) for seed in args.seeds]
            for kind, target in TARGETS.items() for granularity in GRANULARITIES}
    lines = [f"# adaptive_clipping: per layer or per tensor ({len(args.seeds)} seeds, {args.steps} steps, warm-up "
             f"{args.warmup}, outlier x{OUTLIER:g} at step {args.outlier_step}; `python {' '.join(sys.argv)}`)", "",
             "median (range) over seeds", "",
             "| granularity, outlier in | buckets | outlier got through (x its norm the step before) | "
             "clean steps: buckets clipped | median factor of those |", "| --- | --- | --- | --- | --- |"]
    for name, found in runs.items():
        lines.append(f"| {name} | {found[0]['buckets']} | {median_range([r['passed'] for r in found])} | "
                     f"{median_range([r['clipped_share'] for r in found])} | "
                     f"{median_range([r['median_factor'] for r in found])} |")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "adagc_granularity.md"), "w") as out:
        out.write("\n".join(lines) + "\n")
    with open(os.path.join(RESULTS, "adagc_granularity.json"), "w") as out:
        json.dump({"args": vars(args), "targets": TARGETS, "runs": runs}, out, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
