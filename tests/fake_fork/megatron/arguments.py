"""The fork's flags the fake fork uses; the layer-grad-norms group is added as the patch adds it."""

import argparse

from megatron_integration import add_layer_grad_norms_args


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    integers = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--micro-batch-size",
                "--global-batch-size", "--train-iters", "--vocab-size", "--log-interval", "--tensorboard-log-interval",
                "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--zero-stage", "--seed")
    for flag in integers:
        parser.add_argument(flag, type=int, required=True)
    for flag in ("--data-path", "--tensorboard-dir", "--deepspeed_config"):
        parser.add_argument(flag, required=True)
    for flag in ("--deepspeed", "--no-pipeline-parallel", "--bf16"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--local_rank", type=int, default=0)
    parser = add_layer_grad_norms_args(parser)
    args, _ = parser.parse_known_args()  # the schedule, optimizer and CPU flags the fake fork ignores
    return args
