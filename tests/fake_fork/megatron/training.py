"""The fake fork's training loop, shaped like the fork's: ``pretrain`` -> ``train`` -> ``train_step`` and
``training_log`` per iteration; the non-pipeline ``train_step`` returns no grad norm, as the fork's does."""

import json

import deepspeed
import numpy as np
import torch
import torchvision  # noqa: F401  the fork imports it at module level (vision models)
from deepspeed.compression.compress import init_compression  # noqa: F401  removed in DeepSpeed 0.19
from torch.utils.tensorboard import SummaryWriter

from megatron.arguments import parse_args
from megatron.model.transformer import GPTModel
from megatron_integration import layer_grad_norms_ds_config, log_layer_grad_norms


def pretrain() -> None:
    args = parse_args()
    assert args.tensor_model_parallel_size == 1 and args.no_pipeline_parallel, "the fake fork has no model parallelism"
    deepspeed.init_distributed(dist_backend="gloo")
    args.rank, args.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(args.seed)
    model = GPTModel(args.vocab_size + 1, args.seq_length, args.num_layers, args.hidden_size, args.num_attention_heads)
    with open(args.deepspeed_config) as config_file:
        ds_config = json.load(config_file)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=layer_grad_norms_ds_config(args, ds_config))
    writer = SummaryWriter(args.tensorboard_dir) if args.rank == args.world_size - 1 else None
    train(args, engine, batches(args), writer)
    if writer is not None:
        writer.close()


def batches(args):
    tokens = np.fromfile(args.data_path + ".bin", dtype=np.int32)
    generator = np.random.default_rng(args.seed + args.rank)
    while True:
        starts = generator.integers(0, len(tokens) - args.seq_length - 1, args.micro_batch_size)
        yield torch.from_numpy(np.stack([tokens[s:s + args.seq_length + 1] for s in starts]).astype(np.int64))


def train(args, engine, data_iterator, writer) -> None:
    args.consumed_train_samples = args.consumed_train_tokens = 0
    for iteration in range(1, args.train_iters + 1):
        loss, _, grad_norm, _ = train_step(None, data_iterator, [engine], None, None, None)
        args.consumed_train_samples += args.global_batch_size
        args.consumed_train_tokens += args.global_batch_size * args.seq_length
        training_log(args, loss, grad_norm, iteration, writer, [engine])


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config):
    """The fork's signature; returns ``(loss, skipped, grad_norm, num_zeros)`` with ``grad_norm = None`` and the
    loss averaged over the data-parallel ranks, the same on every rank, as the fork's ``loss_dict['lm loss']``."""
    engine = model[0]
    losses = []
    for _ in range(engine.gradient_accumulation_steps()):
        loss = engine(next(data_iterator))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    reduced = torch.stack(losses).mean()
    torch.distributed.all_reduce(reduced)
    return reduced.item() / torch.distributed.get_world_size(), 0, None, None


def training_log(args, loss, grad_norm, iteration, writer, model) -> None:
    layer_grad_norms_string = log_layer_grad_norms(model[0], iteration, writer, args, loss=loss)
    if writer is not None and iteration % args.tensorboard_log_interval == 0 and grad_norm is not None:
        writer.add_scalar("grad-norm/grad-norm", grad_norm, iteration)
    if iteration % args.log_interval == 0 and args.rank == args.world_size - 1:
        log_string = f" iteration {iteration:8d}/{args.train_iters:8d} | lm loss: {loss:.6E} |"
        if grad_norm is not None:
            log_string += f" grad norm: {grad_norm:.3f} |"
        print(log_string + layer_grad_norms_string, flush=True)
