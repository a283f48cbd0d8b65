"""The demo: train the tiny GPT under ZeRO on CPU ranks and show per-layer gradient norms.

It answers the NormFormer question for this small run: under Pre-LN, are the gradients of the
early layers larger than those of the late layers?
"""

import json
import os
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from .cpu_launch import launch
from .tiny_gpt import TinyGPT, TinyGPTConfig, synthetic_batch


@dataclass
class DemoOptions:
    steps: int = 200
    num_layers: int = 12
    hidden: int = 64
    zero_stage: int = 2
    world_size: int = 2
    arch: str = "preln"
    layers: str = "0,1,mid,-2,-1"
    micro_batch: int = 8
    out: str = "runs/demo"


def train_rank(options: DemoOptions) -> Optional[List[Dict]]:
    """One rank's training loop; rank 0 returns the measured statistics of every step."""
    import deepspeed
    from deepspeed import comm as dist

    import deepspeed_patch

    deepspeed_patch.install()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model_config = TinyGPTConfig(vocab_size=256, seq_len=32, hidden=options.hidden, num_layers=options.num_layers,
                                 num_heads=4, pre_ln=options.arch == "preln")
    torch.manual_seed(0)
    model = TinyGPT(model_config)
    ds_config = {
        "train_micro_batch_size_per_gpu": options.micro_batch,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": options.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "layer_grad_norms": {"enabled": True, "layers": options.layers},
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    records = []
    for step in range(1, options.steps + 1):
        loss = engine(synthetic_batch(model_config, options.micro_batch, seed=step * world_size + rank))
        engine.backward(loss)
        engine.step()
        measured = engine.get_layer_grad_norms()
        records.append({"loss": loss.item(), **measured})
        if rank == 0 and (step % max(1, options.steps // 10) == 0 or step == options.steps):
            print(f"[demo] step {step:>5}/{options.steps}  loss {loss.item():.3f}  "
                  f"grad norm {float(engine.get_global_grad_norm()):.3f}", flush=True)
    engine.destroy()
    return records if rank == 0 else None


def early_late_ratio(records: List[Dict]) -> float:
    """Median over the second half of the run of mean norm of the first two / last two layers."""
    ratios = []
    for record in records[len(records) // 2:]:
        layers = sorted(key for key in record["pre_clip"] if isinstance(key, int))
        early = [record["pre_clip"][key]["norm"] for key in layers[:2]]
        late = [record["pre_clip"][key]["norm"] for key in layers[-2:]]
        ratios.append(statistics.mean(early) / statistics.mean(late))
    return statistics.median(ratios)


def summary(records: List[Dict], options: DemoOptions) -> str:
    """A per-layer table of median pre-clip norms and the one-line answer."""
    window = records[len(records) // 2:]
    keys = [key for key in records[-1]["pre_clip"] if isinstance(key, int)]
    lines = [f"per-layer gradient norm, median over steps {window[0]['step']}-{window[-1]['step']} "
             f"({options.arch}, {options.num_layers} layers, ZeRO-{options.zero_stage}, {options.world_size} ranks):"]
    for key in keys:
        norms = [record["pre_clip"][key]["norm"] for record in window]
        lines.append(f"  layer {key:>3}: {statistics.median(norms):.4e}")
    ratio = early_late_ratio(records)
    answer = "larger" if ratio > 1 else "not larger"
    lines.append(f"early/late ratio (layers 0,1 vs -2,-1): {ratio:.2f} -> early layers' gradients are {answer} "
                 "than late layers' in this run")
    return "\n".join(lines)


def run_demo(options: DemoOptions) -> str:
    """Train, write ``layer_grad_norms.jsonl`` into ``options.out``, and return the summary."""
    records = launch(train_rank, options.world_size, options)[0]
    os.makedirs(options.out, exist_ok=True)
    path = os.path.join(options.out, "layer_grad_norms.jsonl")
    with open(path, "w") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")
    return summary(records, options) + f"\nper-step statistics: {path}"
