"""What each rank runs in the pipeline tests: the tiny GPT as a 2-stage PipelineModule.

The reference is the same network as an ordinary TinyGPT with the same weights (gathered from
all stages before each step), run in plain PyTorch on the same micro-batches.
"""

import dataclasses
import functools
import logging
import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch

import deepspeed_patch
from megatron_integration.tiny_gpt import TinyGPT, TinyGPTConfig, synthetic_batch, tiny_gpt_pipe
from reference import averaged_gradients, bucket_stats
from releases import pipeline_gradient_factor
from setup_workers import counting_collectives
from zero_workers import (
    DTYPES,
    FP16_INITIAL_SCALE_POWER,
    MICRO_BATCH,
    force_fp16_on_cpu,
    fused_sgd,
    loss_scale,
    master_of_param,
)

DEFAULT_CASE: Dict[str, Any] = {"first_layer_index": 3, "dtype": "fp32", "gas": 2, "clip": 0.0, "steps": 3,
                                "layers": 4, "tie": False, "stage": 1, "fused": False, "overflow_step": None,
                                "compare_off": False, "kinds": ()}
KIND_OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
"""The optimizer of a case with ``kinds`` (``optimizer_statistics``: the update and moments need Adam)."""
# An fp16 step's loss times this overflows: every gradient of the step is non-finite.
OVERFLOW_FACTOR = 1e30


def plain_name(pipe_name: str, first_layer_index: int, num_layers: int) -> str:
    """The TinyGPT name of a parameter of the pipelined tiny GPT (spec index, or the tie key, first)."""
    index, _, rest = pipe_name.partition(".")
    if index == "tied_modules":
        return rest.partition(".")[2]  # tied_modules.embed.<EmbeddingPipe parameter>
    index = int(index)
    if index == 1:
        return rest  # EmbeddingPipe holds embed and pos_embed
    if first_layer_index <= index < first_layer_index + num_layers:
        return f"layers.{index - first_layer_index}.{rest}"
    return f"{'final_layernorm' if index == first_layer_index + num_layers else 'head'}.{rest}"


def full_weights(engine, case, value_of: Callable[[torch.nn.Parameter], torch.Tensor] = None
                 ) -> Tuple[Dict[str, torch.Tensor], Dict[str, int]]:
    """Every stage's weights (or ``value_of`` each parameter), under TinyGPT names, on every rank, and the stage
    that holds each; the first stage's copy of tied ones."""
    import torch.distributed as dist  # deepspeed.comm has no all_gather_object before 0.15

    value_of = value_of or (lambda param: param.detach().float().clone())
    local = {plain_name(name, case["first_layer_index"], case["layers"]): value_of(p)
             for name, p in engine.module.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    # A tied module's copy on a later stage is only used for its tied weight (the head); the
    # first stage's copy is the one whose other parameters (pos_embed) the model really uses.
    stage_of = {name: stage for stage, part in reversed(list(enumerate(gathered))) for name in part}
    return {name: weight for part in reversed(gathered) for name, weight in part.items()}, stage_of


def full_master_weights(engine, case) -> Optional[Dict[str, torch.Tensor]]:
    """Every stage's copy of the optimizer's fp32 master weights (``zero_workers.master_weights``), under TinyGPT
    names, on every rank; None for an optimizer that keeps none (the same on every rank: fp32)."""
    master_of = master_of_param(engine.optimizer, list(engine.module.named_parameters()))
    return None if master_of is None else full_weights(engine, case, master_of)[0]


def trained_gradients(weights: Dict[str, torch.Tensor], stage_of: Dict[str, int], config: TinyGPTConfig,
                      case: Dict[str, Any], batches) -> Dict[str, torch.Tensor]:
    """The gradient this DeepSpeed release's pipeline really steps on: the mean gradient, scaled per stage
    as ``releases.pipeline_gradient_factor`` says. A tied embedding's two uses (the embedding on the first
    stage, the head on the last) are computed apart, untied, and each scaled by its own stage's factor."""
    stages = max(stage_of.values()) + 1
    if config.tie_embeddings:
        weights = {**weights, "head.weight": weights["embed.weight"]}
        stage_of = {**stage_of, "head.weight": stages - 1}
    untied = dataclasses.replace(config, tie_embeddings=False)
    # fp16: the reference scales its loss as the engine's first scale does, so no gradient flushes to zero.
    scale = 2.0**FP16_INITIAL_SCALE_POWER if case["dtype"] == "fp16" else 1.0
    mean = averaged_gradients(weights, untied, DTYPES[case["dtype"]], batches, loss_scale=scale)
    grads = {name: grad * pipeline_gradient_factor(case["gas"], stage_of[name], stages) for name, grad in mean.items()}
    if config.tie_embeddings:
        grads["embed.weight"] = grads["embed.weight"] + grads.pop("head.weight")
    return grads


def ds_config(case: Dict[str, Any], enabled: bool) -> Dict[str, Any]:
    """The case's ds_config (also the 3D workers'). bf16 under ZeRO accumulates in fp32 (BF16_Optimizer, as
    BLOOM); without ZeRO in bf16, the only accumulation DeepSpeed allows there."""
    ds_config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": case["gas"],
        "gradient_clipping": case["clip"],
        "zero_optimization": {"stage": case["stage"]},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if enabled:
        ds_config["layer_grad_norms"] = {"enabled": True, "optimizer_statistics": list(case.get("kinds", ())),
                                         **case.get("block", {})}
    if case["dtype"] == "bf16":
        ds_config["bf16"] = {"enabled": True}
        if case["stage"] > 0:
            ds_config["data_types"] = {"grad_accum_dtype": "fp32"}
    if case["dtype"] == "fp16":
        ds_config["fp16"] = {"enabled": True, "initial_scale_power": FP16_INITIAL_SCALE_POWER, "loss_scale_window": 2}
    return ds_config


def train_pipe(case: Dict[str, Any], enabled: bool = True) -> Dict[str, Any]:
    import deepspeed
    from deepspeed import comm as dist

    config = TinyGPTConfig(num_layers=case["layers"], tie_embeddings=case["tie"])
    torch.manual_seed(0)
    plain = dict(TinyGPT(config).named_parameters())
    pipe = tiny_gpt_pipe(config, num_stages=dist.get_world_size(), first_layer_index=case["first_layer_index"])
    with torch.no_grad():
        for name, param in pipe.named_parameters():
            param.copy_(plain[plain_name(name, case["first_layer_index"], case["layers"])])
    loss_factor = blow_up_loss(pipe)
    optimizer = functools.partial(fused_sgd if case["fused"] else torch.optim.SGD, lr=1.0)
    if case["kinds"]:
        optimizer = KIND_OPTIMIZER
    engine, *_ = deepspeed.initialize(model=pipe, model_parameters=[p for p in pipe.parameters()],
                                      optimizer=optimizer, config=ds_config(case, enabled))
    record = {"measured": [], "global_norm": [], "reference": [], "update": [], "applied_master": [],
              "master_before": [], "loss_scales": [], "collectives": [], "kind_reference": [],
              "optimizer": type(engine.optimizer).__name__}
    for step in range(1, case["steps"] + 1):
        batches = [synthetic_batch(config, MICRO_BATCH, seed=100 * step + micro) for micro in range(case["gas"])]
        before, stage_of = full_weights(engine, case)
        master_before = full_master_weights(engine, case)
        scale_before = loss_scale(engine.optimizer)
        loss_factor[0] = OVERFLOW_FACTOR if step == case["overflow_step"] else 1.0
        with counting_collectives() as collectives:
            engine.train_batch(data_iter=iter([(batch[:, :-1], batch[:, 1:]) for batch in batches]))
        record["collectives"].append(collectives[0])
        record["loss_scales"].append((scale_before, loss_scale(engine.optimizer)))
        record["measured"].append(engine.get_layer_grad_norms())
        record["global_norm"].append(global_norm(engine))
        after = full_weights(engine, case)[0]
        record["update"].append(update_norm(before, after))
        master_after = full_master_weights(engine, case)
        record["applied_master"].append(None if master_before is None else bucket_stats(
            {name: master_before[name] - master_after[name] for name in master_before}))
        record["master_before"].append(None if master_before is None else bucket_stats(master_before))
        if case["kinds"]:
            record["kind_reference"].append(kind_reference(engine, case, before, after))
        grads = trained_gradients(before, stage_of, config, case, batches)
        record["reference"].append(bucket_stats(grads))
    record["final"] = full_weights(engine, case)[0]
    record["tied"] = {name: param.detach().clone() for name, param in engine.module.named_parameters()
                      if name.startswith("tied_modules.")}  # this stage's own copy
    engine.destroy()
    return record


def kind_reference(engine, case, before: Dict[str, torch.Tensor], after: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """Per bucket, the statistics of the full fp32 weights after the step, of after minus before, and of the
    moments after it, gathered from every stage (DeepSpeed's ``safe_get_full_optimizer_state``)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    named = {"param": after, "update": {name: after[name] - before[name] for name in before}}
    for moment in ("exp_avg", "exp_avg_sq"):
        state_of = functools.partial(safe_get_full_optimizer_state, optim_state_key=moment)
        named[moment] = full_weights(engine, case, state_of)[0]
    return {kind: bucket_stats(values) for kind, values in named.items()}


def blow_up_loss(pipe) -> list:
    """Wrap ``pipe``'s loss function; the returned one-element list is the factor it multiplies the loss by."""
    factor = [1.0]
    plain_loss = pipe.loss_fn
    pipe.loss_fn = lambda outputs, labels: plain_loss(outputs, labels) * factor[0]
    return factor


def global_norm(engine) -> Optional[float]:
    """The engine's global gradient norm of the last step; ``None`` in fp32 without ZeRO (none is kept)."""
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def update_norm(before: Dict[str, torch.Tensor], after: Dict[str, torch.Tensor]) -> float:
    """The norm of the whole model's step: SGD with lr 1 steps by the gradient the optimizer really applied."""
    return math.sqrt(sum(float((before[name] - after[name]).double().pow(2).sum()) for name in before))


def run_cases(train: Callable[..., Dict[str, Any]], defaults: Dict[str, Any],
              cases: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """``train`` on every case (``defaults`` updated by its overrides) in one launch, and again with the
    feature off where the case says ``compare_off``; a case's error is returned instead of stopping the
    others."""
    import traceback

    deepspeed_patch.install()
    force_fp16_on_cpu()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    results = {}
    for name, overrides in cases.items():
        case = {**defaults, **overrides}
        try:
            results[name] = {"on": train(case), "case": case}
            if case.get("compare_off"):
                results[name]["off"] = train(case, enabled=False)
        except Exception as error:
            results[name] = {"error": traceback.format_exc(), "message": str(error), "case": case}
    return results


def run_pipeline_cases(cases: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    return run_cases(train_pipe, DEFAULT_CASE, cases)
