"""What each rank runs in the tensor-parallel test: a Megatron-style column/row-parallel MLP stack.

TP=2 on 2 CPU ranks through a minimal Megatron-style ``mpu``. The reference rebuilds the full,
unsharded model from both ranks' shards and computes its gradient in plain PyTorch.
"""

import logging
from typing import Any, Dict

import torch
from torch import nn
from torch.nn import functional as F

import deepspeed_patch
from pipeline_workers import global_norm, update_norm
from reference import bucket_stats

HIDDEN, VOCAB, SEQ, LAYERS, MICRO_BATCH = 16, 64, 8, 3, 2


class TensorParallelUnit:
    """The slice of Megatron's ``mpu`` DeepSpeed reads: every rank in one TP group, no data parallelism."""

    def __init__(self) -> None:
        from deepspeed import comm as dist

        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.tp_group = dist.new_group(ranks=list(range(self.world_size)))
        self.dp_groups = [dist.new_group(ranks=[rank]) for rank in range(self.world_size)]

    def get_model_parallel_rank(self) -> int:
        return self.rank

    def get_model_parallel_world_size(self) -> int:
        return self.world_size

    def get_model_parallel_group(self):
        return self.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return 0

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_world_size(self) -> int:
        return 1

    def get_data_parallel_group(self):
        return self.dp_groups[self.rank]


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        from deepspeed import comm as dist

        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce forward; identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, x, group):
        from deepspeed import comm as dist

        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TensorParallelMLPLayer(nn.Module):
    """Pre-LN residual MLP: replicated norm, column-parallel fc1, row-parallel fc2 with replicated bias."""

    def __init__(self, tp_size: int, group) -> None:
        super().__init__()
        self.group = group
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.dense_h_to_4h = nn.Linear(HIDDEN, 4 * HIDDEN // tp_size)
        self.dense_4h_to_h = nn.Linear(4 * HIDDEN // tp_size, HIDDEN, bias=False)
        self.dense_4h_to_h_bias = nn.Parameter(torch.zeros(HIDDEN))
        for param in (self.dense_h_to_4h.weight, self.dense_h_to_4h.bias, self.dense_4h_to_h.weight):
            param.tensor_model_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.group is None:  # the unsharded reference
            return x + self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(h))) + self.dense_4h_to_h_bias
        partial = self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(_CopyToTensorParallel.apply(h, self.group))))
        return x + _ReduceFromTensorParallel.apply(partial, self.group) + self.dense_4h_to_h_bias


class TensorParallelModel(nn.Module):
    """Replicated embedding and head around ``LAYERS`` tensor-parallel MLP layers."""

    def __init__(self, tp_size: int = 1, group=None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(TensorParallelMLPLayer(tp_size, group) for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def full_model(shards) -> TensorParallelModel:
    """The unsharded model whose fc1 rows and fc2 columns are the TP ranks' shards, in rank order."""
    model = TensorParallelModel()
    with torch.no_grad():
        for name, param in model.named_parameters():
            pieces = [shard[name] for shard in shards]
            if name.endswith("dense_h_to_4h.weight") or name.endswith("dense_h_to_4h.bias"):
                param.copy_(torch.cat(pieces, dim=0))
            elif name.endswith("dense_4h_to_h.weight"):
                param.copy_(torch.cat(pieces, dim=1))
            else:
                param.copy_(pieces[0])
    return model


def gathered_shards(model: nn.Module):
    from deepspeed import comm as dist

    local = {name: p.detach().clone() for name, p in model.named_parameters()}
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, local)
    return shards


def run_tensor_parallel(clip: float, steps: int = 3, stage: int = 1) -> Dict[str, Any]:
    import deepspeed
    from deepspeed import comm as dist

    deepspeed_patch.install()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    mpu = TensorParallelUnit()
    torch.manual_seed(1 + dist.get_rank())  # different shards on each rank; replicated parts synced below
    model = TensorParallelModel(mpu.world_size, mpu.tp_group)
    with torch.no_grad():
        for param in model.parameters():
            if not getattr(param, "tensor_model_parallel", False):
                dist.broadcast(param, src=0)
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "layer_grad_norms": {"enabled": True},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                      config=config, mpu=mpu)
    record = {"measured": [], "global_norm": [], "reference": [], "update": []}
    for step in range(steps):
        batch = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
        reference = full_model(gathered_shards(engine.module))
        reference(batch).backward()
        record["reference"].append(bucket_stats({n: p.grad for n, p in reference.named_parameters()}))
        engine.backward(engine(batch))
        engine.step()
        record["measured"].append(engine.get_layer_grad_norms())
        record["global_norm"].append(global_norm(engine))
        after = full_model(gathered_shards(engine.module))
        record["update"].append(update_norm(dict(reference.named_parameters()), dict(after.named_parameters())))
    engine.destroy()
    return record
