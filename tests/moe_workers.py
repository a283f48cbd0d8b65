"""What each rank runs in the Mixture-of-Experts test: a tiny model with DeepSpeed's ``MoE`` under ZeRO-1/2.

The model: an embedding, two layers each of a dense projection and an MoE block (``deepspeed.moe.layer.MoE``,
2 experts, top-1 routing, room for every token), and a head. Each case trains a few steps with the feature on
and records what it reports, DeepSpeed's global norm, and, on rank 0, the plain-PyTorch reference: the
gradient of the loss averaged over the ranks' batches, of the full model (every expert), computed from the
weights gathered from all ranks (``reference_gradients``).
"""

import logging
from typing import Any, Dict, List

import torch
import torch.nn.functional as F

from reference import bucket_stats

VOCAB, HIDDEN, SEQ, BATCH, LAYERS, EXPERTS = 32, 8, 8, 2, 2, 2
GATE = "moe.deepspeed_moe.gate.wg.weight"
EXPERT = "moe.deepspeed_moe.experts.deepspeed_experts"


class TinyMoE(torch.nn.Module):
    """Embedding, ``LAYERS`` x (dense projection, MoE block), head."""

    def __init__(self, ep_size: int) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList()
        for _ in range(LAYERS):
            layer = torch.nn.Module()
            layer.dense = torch.nn.Linear(HIDDEN, HIDDEN)
            # Capacity for every token (capacity_factor = experts, min_capacity 0) and no random selection:
            # top-1 routing the reference reproduces exactly.
            layer.moe = MoE(HIDDEN, torch.nn.Linear(HIDDEN, HIDDEN), num_experts=EXPERTS, ep_size=ep_size, k=1,
                            capacity_factor=float(EXPERTS), min_capacity=0, use_rts=False)
            self.layers.append(layer)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(batch[:, :-1])
        for layer in self.layers:
            hidden = torch.tanh(layer.dense(hidden))
            hidden = hidden + layer.moe(hidden)[0]
        return F.cross_entropy(self.head(hidden).flatten(0, 1), batch[:, 1:].flatten())


def reference_loss(weights: Dict[str, torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
    """``TinyMoE``'s loss in plain PyTorch from its full weights (every expert, by global index): top-1
    routing, each token's expert output weighted by its softmax gate probability."""
    hidden = F.embedding(batch[:, :-1], weights["embed.weight"])
    for index in range(LAYERS):
        prefix = f"layers.{index}."
        hidden = torch.tanh(F.linear(hidden, weights[prefix + "dense.weight"], weights[prefix + "dense.bias"]))
        tokens = hidden.reshape(-1, HIDDEN)
        gates = F.softmax(tokens @ weights[prefix + GATE].t(), dim=-1)
        chosen = gates.argmax(dim=-1)
        experts = torch.stack([
            F.linear(tokens, weights[f"{prefix}{EXPERT}.{expert}.weight"], weights[f"{prefix}{EXPERT}.{expert}.bias"])
            for expert in range(EXPERTS)
        ])
        routed = experts[chosen, torch.arange(tokens.shape[0])] * gates.gather(1, chosen[:, None])
        hidden = hidden + routed.reshape(hidden.shape)
    logits = F.linear(hidden, weights["head.weight"], weights["head.bias"])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def reference_gradients(weights: Dict[str, torch.Tensor], batches: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The gradient (float64) of the loss averaged over ``batches`` (one per rank)."""
    leaves = {name: weight.double().requires_grad_() for name, weight in weights.items()}
    loss = sum(reference_loss(leaves, batch) for batch in batches) / len(batches)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return dict(zip(leaves, grads))


def moe_key(name: str):
    """The documented bucket: layer N's experts ``"N.experts"``, its router ``"N.gate"``, the rest of it N;
    outside the layers, the module."""
    if not name.startswith("layers."):
        return name.rpartition(".")[0]
    layer = name.split(".")[1]
    if EXPERT in name:
        return f"{layer}.experts"
    return f"{layer}.gate" if GATE in name else int(layer)


def layer_key(name: str):
    """The bucket of the whole layer: what the three MoE buckets of a layer add up to."""
    return int(name.split(".")[1]) if name.startswith("layers.") else name.rpartition(".")[0]


def batch_of(step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)


def full_weights(model: TinyMoE, ep_size: int) -> Dict[str, torch.Tensor]:
    """Every weight of the model, the experts of all expert-parallel ranks under their global index
    (collective: every rank calls it)."""
    from deepspeed import comm as dist
    from deepspeed.utils import groups

    local = {name: param.detach().clone() for name, param in model.named_parameters()}
    gathered: List[Any] = [None] * dist.get_world_size()
    ep_rank = groups._get_expert_parallel_rank(f"ep_size_{ep_size}")
    dist.all_gather_object(gathered, (ep_rank, local))
    weights = {}
    for ep_rank, named in gathered:
        for name, weight in named.items():
            if EXPERT in name:
                head, _, tail = name.partition(EXPERT + ".")
                local_index, _, rest = tail.partition(".")
                name = f"{head}{EXPERT}.{ep_rank * (EXPERTS // ep_size) + int(local_index)}.{rest}"
            weights[name] = weight
    return weights


def distinct_experts(model: TinyMoE, ep_size: int) -> None:
    """Give every expert (global index) weights of its own: ``MoE`` deep-copies one expert."""
    from deepspeed.utils import groups

    ep_rank = groups._get_expert_parallel_rank(f"ep_size_{ep_size}")
    for index, (name, param) in enumerate(model.named_parameters()):
        if EXPERT in name:
            generator = torch.Generator().manual_seed(1000 * ep_rank + index)
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)


def train(case: Dict[str, Any]) -> Dict[str, Any]:
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyMoE(case["ep_size"])
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "all"})
    optimizer = torch.optim.SGD(params, lr=0.5)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_clipping": case["clip"],
        "zero_optimization": {"stage": case["stage"]},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "layer_grad_norms": {"enabled": True},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    distinct_experts(engine.module, case["ep_size"])
    record = {"measured": [], "global_norm": [], "reference": [], "layer_reference": [], "has_moe": False}
    record["has_moe"] = engine.has_moe_layers
    for step in range(1, case["steps"] + 1):
        weights = full_weights(engine.module, case["ep_size"])
        engine.backward(engine(batch_of(step, rank)))
        engine.step()
        record["measured"].append(engine.get_layer_grad_norms())
        record["global_norm"].append(float(engine.get_global_grad_norm()))
        if rank == 0:
            grads = reference_gradients(weights, [batch_of(step, r) for r in range(world_size)])
            record["reference"].append(bucket_stats(grads, moe_key))
            record["layer_reference"].append(bucket_stats(grads, layer_key))
    engine.destroy()
    return record


def run_moe_cases(cases: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Every case on this rank; a failing case is recorded, not raised, so the others still run."""
    import traceback

    import deepspeed_patch

    deepspeed_patch.install()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    results = {}
    for name, case in cases.items():
        try:
            results[name] = train(case)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results
