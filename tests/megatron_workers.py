"""What each rank runs in the Megatron integration test: a training loop that calls the training-log hook.

The tiny GPT as a 2-stage PipelineModule, flags parsed as Megatron would, the ds_config filled by
``layer_grad_norms_ds_config``; the last rank owns the TensorBoard writer, as in the forks.
"""

import argparse
import logging
from typing import Any, Dict, List

import torch

import deepspeed_patch
from megatron_integration import add_layer_grad_norms_args, layer_grad_norms_ds_config, log_layer_grad_norms
from megatron_integration.tiny_gpt import TinyGPTConfig, synthetic_batch, tiny_gpt_pipe
from setup_workers import counting_collectives

MICRO_BATCH, SEQ_LEN = 2, 16


def megatron_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensorboard-log-interval", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=1)
    return add_layer_grad_norms_args(parser).parse_args(argv)


def train_with_training_log(tensorboard_dir: str, argv: List[str], steps: int) -> Dict[str, Any]:
    import deepspeed
    from deepspeed import comm as dist
    from torch.utils.tensorboard import SummaryWriter

    deepspeed_patch.install()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    args = megatron_args(argv)
    config = TinyGPTConfig(num_layers=6, seq_len=SEQ_LEN)
    torch.manual_seed(0)
    pipe = tiny_gpt_pipe(config, num_stages=dist.get_world_size())
    ds_config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 2,
                 "gradient_clipping": 0.5, "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=pipe, model_parameters=[p for p in pipe.parameters()],
                                      optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                                      config=layer_grad_norms_ds_config(args, ds_config))
    last_rank = dist.get_rank() == dist.get_world_size() - 1
    writer = SummaryWriter(tensorboard_dir) if last_rank else None
    record = {"measured": [], "log_fields": [], "collectives_in_log_call": 0}
    args.consumed_train_samples = 0
    for iteration in range(1, steps + 1):
        batches = [synthetic_batch(config, MICRO_BATCH, seed=10 * iteration + micro) for micro in range(2)]
        engine.train_batch(data_iter=iter([(batch[:, :-1], batch[:, 1:]) for batch in batches]))
        args.consumed_train_samples += 2 * MICRO_BATCH
        with counting_collectives() as calls:
            record["log_fields"].append(log_layer_grad_norms(engine, iteration, writer, args))
        record["collectives_in_log_call"] += calls[0]
        record["measured"].append(engine.get_layer_grad_norms())
    if writer is not None:
        writer.close()
    engine.destroy()
    return record
