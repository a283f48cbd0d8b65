"""What each rank runs in the 3D tests: tensor x pipeline x data parallelism, ZeRO-1 or BF16_Optimizer; and
without ZeRO (stage 0) in fp32, fp16 (with an overflow step) and bf16.

The model is ``tp_workers``' column/row-parallel MLP stack; with pipeline stages it is a
``PipelineModule`` of the same modules (embedding, the TP layers, head). Ranks follow DeepSpeed's
``PipeModelDataParallelTopology``. Each data-parallel rank trains on its own batch; the reference
rebuilds the unsharded model from every stage's and every TP rank's weights and averages its gradient
over the data-parallel ranks' batches, in plain PyTorch.
"""

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn
from torch.nn import functional as F

from pipeline_workers import OVERFLOW_FACTOR, blow_up_loss, ds_config, global_norm, run_cases
from reference import bucket_stats
from tp_workers import HIDDEN, LAYERS, MICRO_BATCH, SEQ, VOCAB, TensorParallelMLPLayer, TensorParallelModel, full_model
from zero_workers import DTYPES, FP16_INITIAL_SCALE_POWER, fused_sgd, loss_scale, master_of_param

DEFAULT_CASE: Dict[str, Any] = {"pp": 1, "tp": 2, "dp": 2, "dtype": "fp32", "clip": 0.05, "steps": 2, "stage": 1,
                                "fused": False, "overflow_step": None, "compare_off": False}
# The buckets outside the layers: under pipeline parallelism named after the spec's class.
PIPELINE_NAMES = {"embed": "Embedding", "head": "Linear"}


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def build_model(case: Dict[str, Any], tp_rank: int, tp_group):
    """The replicated parts seeded alike on every rank, the TP shards by TP rank (alike across DP ranks)."""
    torch.manual_seed(0)
    embed, head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB)
    torch.manual_seed(1 + tp_rank)
    layers = [TensorParallelMLPLayer(case["tp"], tp_group) for _ in range(LAYERS)]
    if case["pp"] == 1:
        model = TensorParallelModel(case["tp"], tp_group)
        model.embed, model.head, model.layers = embed, head, nn.ModuleList(layers)
        return model
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topology = PipeModelDataParallelTopology(num_pp=case["pp"], num_mp=case["tp"], num_dp=case["dp"])
    return PipelineModule(layers=[embed, *layers, head], topology=topology, loss_fn=cross_entropy)


def plain_name(name: str, pipelined: bool) -> str:
    """The ``TensorParallelModel`` name of a parameter (a pipeline's spec index first)."""
    if not pipelined:
        return name
    index, _, rest = name.partition(".")
    index = int(index)
    if index == 0:
        return f"embed.{rest}"
    return f"layers.{index - 1}.{rest}" if index <= LAYERS else f"head.{rest}"


def unsharded_model(engine, case: Dict[str, Any], tp_rank: int,
                    value_of: Callable[[torch.nn.Parameter], torch.Tensor] = None) -> nn.Module:
    """The unsharded model built from every stage's and every TP rank's weights (or ``value_of`` each
    parameter), on every rank."""
    import torch.distributed as dist  # deepspeed.comm has no all_gather_object before 0.15

    value_of = value_of or (lambda param: param.detach().float().clone())
    pipelined = case["pp"] > 1
    local = {plain_name(name, pipelined): value_of(p) for name, p in engine.module.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (tp_rank, local))
    shards = [{} for _ in range(case["tp"])]
    for rank_tp, part in gathered:
        shards[rank_tp].update(part)
    return full_model(shards)


def engine_names(case: Dict[str, Any], stats: Dict[Any, Any]) -> Dict[Any, Any]:
    """Bucket statistics under the engine's bucket names (a pipeline's spec classes outside the layers)."""
    return {PIPELINE_NAMES.get(key, key) if case["pp"] > 1 else key: value for key, value in stats.items()}


def reference_stats(engine, case: Dict[str, Any], tp_rank: int, batches: List[torch.Tensor]):
    """Per-bucket statistics of the unsharded model's gradient, averaged over the DP ranks' batches."""
    model = unsharded_model(engine, case, tp_rank).to(DTYPES[case["dtype"]])
    # fp16: the loss scaled as the engine's first scale does, so that no gradient flushes to zero
    scale = 2.0**FP16_INITIAL_SCALE_POWER if case["dtype"] == "fp16" else 1.0
    for batch in batches:
        (model(batch) * (scale / len(batches))).backward()
    return engine_names(case, bucket_stats({name: p.grad.double() / scale for name, p in model.named_parameters()}))


def unsharded_weights(engine, case: Dict[str, Any], tp_rank: int) -> Dict[str, torch.Tensor]:
    """The unsharded model's weights, as fp32 copies, on every rank."""
    return {name: param.detach().clone() for name, param in unsharded_model(engine, case, tp_rank).named_parameters()}


def unsharded_masters(engine, case: Dict[str, Any], tp_rank: int) -> Optional[Dict[str, torch.Tensor]]:
    """The unsharded model's fp32 master weights, as the fp16 and bf16 optimizers without ZeRO keep them
    (``zero_workers.master_weights``); None under ZeRO or where the optimizer keeps none (fp32)."""
    if case["stage"] != 0:
        return None
    master_of = master_of_param(engine.optimizer, list(engine.module.named_parameters()))
    if master_of is None:
        return None
    model = unsharded_model(engine, case, tp_rank, master_of)
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def train(case: Dict[str, Any], enabled: bool = True) -> Dict[str, Any]:
    import deepspeed
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

    topology = PipeModelDataParallelTopology(num_pp=case["pp"], num_mp=case["tp"], num_dp=case["dp"])
    grid = PipelineParallelGrid(topology=topology)
    tp_rank, dp_rank = grid.get_slice_parallel_rank(), grid.get_data_parallel_rank()
    model = build_model(case, tp_rank, grid.get_slice_parallel_group())
    if case.get("sequence_parallel"):
        model.embed.weight.sequence_parallel = True  # as Megatron marks its layer norms under --sequence-parallel
    loss_factor = blow_up_loss(model) if case["pp"] > 1 else [1.0]
    engine, *_ = deepspeed.initialize(model=model,
                                      optimizer=(fused_sgd if case["fused"] else torch.optim.SGD)(model.parameters(),
                                                                                                   lr=1.0),
                                      config=ds_config({**case, "gas": 1}, enabled),
                                      mpu=None if case["pp"] > 1 else grid)
    record = {"measured": [], "global_norm": [], "reference": [], "applied": [], "weights_before": [],
              "applied_master": [], "master_before": [], "loss_scales": [],
              "optimizer": type(engine.optimizer).__name__}
    for step in range(1, case["steps"] + 1):
        batches = [
            torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(10 * step + dp))
            for dp in range(case["dp"])
        ]
        record["reference"].append(reference_stats(engine, case, tp_rank, batches))
        batch = batches[dp_rank]
        master_before = unsharded_masters(engine, case, tp_rank)
        before = unsharded_weights(engine, case, tp_rank)
        scale_before = loss_scale(engine.optimizer)
        loss_factor[0] = OVERFLOW_FACTOR if step == case["overflow_step"] else 1.0
        if case["pp"] > 1:
            engine.train_batch(data_iter=iter([(batch[:, :-1], batch[:, 1:])]))
        else:
            engine.backward(engine(batch) * loss_factor[0])
            engine.step()
        record["loss_scales"].append((scale_before, loss_scale(engine.optimizer)))
        record["measured"].append(engine.get_layer_grad_norms())
        record["global_norm"].append(global_norm(engine))
        after = unsharded_weights(engine, case, tp_rank)
        # SGD with lr 1: the weights' change is the gradient applied (in fp32; coarser in the weights' bf16 or fp16)
        change = {name: before[name] - after[name] for name in before}
        record["applied"].append(engine_names(case, bucket_stats(change)))
        record["weights_before"].append(engine_names(case, bucket_stats(before)))
        master_after = unsharded_masters(engine, case, tp_rank)
        # SGD with lr 1: the change of the fp32 master weights is the gradient the optimizer applied
        record["applied_master"].append(None if master_before is None else engine_names(case, bucket_stats(
            {name: master_before[name] - master_after[name] for name in master_before})))
        record["master_before"].append(None if master_before is None else
                                       engine_names(case, bucket_stats(master_before)))
    record["final"] = [param.detach().clone() for param in engine.module.parameters()]
    engine.destroy()
    return record


def run_3d_cases(cases: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    return run_cases(train, DEFAULT_CASE, cases)
