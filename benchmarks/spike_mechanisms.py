"""Natural-spike mechanisms: training runs that spike by themselves, under DeepSpeed ZeRO-2 on CPU ranks.

Each mechanism (``Mechanism``) is a model, its data (deterministic per seed) and its optimizer settings; all of them
learn modular addition, ``(a + b) mod P`` from the sequence ``a b =`` with the answer read at the last position
(Power et al. 2022, arXiv 2201.02177), in a small Pre-LN transformer (``ModularTransformer``) whose parameters are
named as the package's layer map expects: ``layers.N.`` for the transformer layers, and the named buckets
``embedding``, ``pos_embedding``, ``final_norm`` and ``head`` outside them.

- ``slingshot``: Adam's slingshot (Thilak et al. 2022, arXiv 2206.04817): AdamW lr 1e-3, betas (0.9, 0.98), weight
  decay 1.0, batch 512, no clipping. It groks, and its loss jumps 5-180x several times after step ~700.
- the other mechanisms of ``MECHANISMS``: settings tried for Adam's second-moment lag (Bai et al. 2025), attention
  logits without QK-norm at a high lr (Wortsman et al. 2023, arXiv 2309.14322) and a small embedding scale
  (Takase et al., arXiv 2312.16903); which of them spike here is in ``benchmarks/results/natural_spikes.md``.

``train`` runs one mechanism on every rank of a launch (``megatron_integration.cpu_launch.launch``): the global batch
split over the ranks, the feature's block (``ds_config``: every layer, the four optimizer statistics, the grad-norm
and loss triggers, a 16-step flight recorder, the JSONL dump) plus any extra ``ds_config`` keys (a remedy arm's
``gradient_clipping``, ``adaptive_clipping``, ``skip_step``) and per-step hooks (``StepHooks``: an injected gradient
outlier). With ``truth``, it also logs the ground truth (``GroundTruth``): every bucket's float64 norms of the
gradient, the update and Adam's moments, every step, computed beside DeepSpeed (a gradient hook, one all-reduce,
Adam's recurrences in float64), not by the package's code.
"""

import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

PRIME = 97
"""The modulus, and the number of answers; the vocabulary adds the ``=`` token."""
EQUALS = PRIME
SEQ_LEN = 3
KINDS = ["param", "update", "exp_avg", "exp_avg_sq"]
TRIGGER = {"grad_norm_factor": 3.0, "loss_factor": 3.0, "window": 50, "capture_steps": 16, "history": 16}
"""The trigger of every run: the global gradient norm or the reported loss above 3x its median over 50 steps fires,
and the flight recorder hands back the last 16 steps (and the blocks before them)."""
INTERVAL = 10
"""The measured steps of the logs besides the recorded ones: the interval steps ``report`` may judge against."""
LAYER_NAME = re.compile(r"^layers\.(\d+)\.")
"""The ground truth's own bucket rule (not the package's layer map): ``layers.N.`` is layer N; any other parameter
is in the bucket of its module's name."""


@dataclass(frozen=True)
class Mechanism:
    """One way to spike: the model, the data and the optimizer; everything but the seed."""

    name: str
    citation: str
    steps: int = 3000
    lr: float = 1e-3
    betas: Tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    weight_decay: float = 1.0
    batch: int = 512
    """The global batch, split evenly over the ranks."""
    train_fraction: float = 0.4
    hidden: int = 128
    heads: int = 4
    num_layers: int = 2
    qk_norm: bool = False
    embed_scale: float = 1.0
    """The embedding's output times this (``sqrt(hidden)`` is the scaled embedding Takase et al. recommend)."""
    init_std: float = 0.02


MECHANISMS: Dict[str, Mechanism] = {
    "slingshot": Mechanism("slingshot", "Thilak et al. 2022 (arXiv 2206.04817), Power et al. 2022"),
    "adam_lag": Mechanism("adam_lag", "Bai et al. 2025: Adam's second moment lags (large beta2, small eps, high lr)",
                          lr=3e-3, betas=(0.9, 0.9999), eps=1e-12, weight_decay=1.0),
    "logit_growth": Mechanism("logit_growth", "Wortsman et al. 2023 (arXiv 2309.14322): attention logits without "
                              "QK-norm at a high lr", lr=1e-2, betas=(0.9, 0.98), weight_decay=0.1),
    "small_embedding": Mechanism("small_embedding", "Takase et al. (arXiv 2312.16903): a small embedding scale",
                                 lr=3e-3, betas=(0.9, 0.98), weight_decay=1.0, embed_scale=1.0, init_std=0.002),
}


# ---------------------------------------------------------------- data


@dataclass
class Split:
    """Every pair ``(a, b)`` as ``a b =`` with its answer, split once per seed into training and held-out pairs."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def split(mechanism: Mechanism, seed: int) -> Split:
    a, b = torch.meshgrid(torch.arange(PRIME), torch.arange(PRIME), indexing="ij")
    x = torch.stack([a.flatten(), b.flatten(), torch.full((PRIME * PRIME, ), EQUALS)], dim=1)
    y = (a.flatten() + b.flatten()) % PRIME
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(mechanism.train_fraction * len(x))
    return Split(x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]])


class Batches:
    """The training batches of a seed: each epoch a fresh permutation of the training pairs, cut into global
    batches of ``mechanism.batch`` (the last short batch of an epoch dropped); the same on every rank."""

    def __init__(self, data: Split, mechanism: Mechanism, seed: int) -> None:
        self.data, self.size = data, mechanism.batch
        self.generator = torch.Generator().manual_seed(10**6 + seed)
        self.order: List[torch.Tensor] = []

    def next(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if not self.order:
            permutation = torch.randperm(len(self.data.train_x), generator=self.generator)
            self.order = list(permutation[:len(permutation) // self.size * self.size].split(self.size))
        picked = self.order.pop(0)
        return self.data.train_x[picked], self.data.train_y[picked]


def shard(batch: Tuple[torch.Tensor, torch.Tensor], rank: int, world_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's contiguous slice of a global batch."""
    return tuple(part.chunk(world_size)[rank] for part in batch)


# ---------------------------------------------------------------- model


class Attention(nn.Module):
    """Causal multi-head self-attention; with ``qk_norm``, queries and keys layer-normed per head."""

    def __init__(self, hidden: int, heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = (part.view(batch, length, self.heads, self.head_dim).transpose(1, 2)
                   for part in self.qkv(x).chunk(3, dim=-1))
        logits = self.q_norm(q) @ self.k_norm(k).transpose(-1, -2) / math.sqrt(self.head_dim)
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        weights = logits.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(batch, length, hidden))


class Block(nn.Module):
    """A Pre-LN transformer layer."""

    def __init__(self, hidden: int, heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, qk_norm)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class ModularTransformer(nn.Module):
    """Token and position embeddings, ``num_layers`` Pre-LN layers, a final norm and the answer's head, read at
    the last position; ``forward`` returns the logits over the ``PRIME`` answers."""

    def __init__(self, mechanism: Mechanism) -> None:
        super().__init__()
        hidden = mechanism.hidden
        self.embed_scale = mechanism.embed_scale
        self.embedding = nn.Embedding(PRIME + 1, hidden)
        self.pos_embedding = nn.Embedding(SEQ_LEN, hidden)
        self.layers = nn.ModuleList(Block(hidden, mechanism.heads, mechanism.qk_norm)
                                    for _ in range(mechanism.num_layers))
        self.final_norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, PRIME, bias=False)
        for name, param in self.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                nn.init.normal_(param, std=mechanism.init_std)
            elif name.endswith("bias"):
                nn.init.zeros_(param)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embedding(tokens) * self.embed_scale + self.pos_embedding(positions)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.final_norm(x)[:, -1])


def build_model(mechanism: Mechanism, seed: int) -> ModularTransformer:
    """The seed's initial weights: the same on every rank and in a plain-PyTorch rerun."""
    torch.manual_seed(seed)
    return ModularTransformer(mechanism)


def build_optimizer(mechanism: Mechanism, model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=mechanism.lr, betas=mechanism.betas, eps=mechanism.eps,
                             weight_decay=mechanism.weight_decay)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=-1) == y).double().mean().item()


# ---------------------------------------------------------------- DeepSpeed


def feature_block(dump: Optional[str], trigger: Optional[Dict[str, Any]] = None, **extra: Any) -> Dict[str, Any]:
    """The ``layer_grad_norms`` block of every run: every layer, the four optimizer statistics, the grad-norm and
    loss triggers with a 16-step recorder (``TRIGGER``, or ``trigger``), the dump at ``dump``; ``extra`` keys
    (``adaptive_clipping``, ``skip_step``) added."""
    block = {"enabled": True, "layers": "all", "interval": INTERVAL, "optimizer_statistics": KINDS,
             "trigger": trigger or TRIGGER, **extra}
    if dump:
        block["dump"] = {"path": dump}
    return block


def ds_config(mechanism: Mechanism, world_size: int, block: Optional[Dict[str, Any]],
              **extra: Any) -> Dict[str, Any]:
    """ZeRO-2 with the mechanism's batch over ``world_size`` ranks, no clipping; ``block`` the feature's
    (``None``: off), ``extra`` top-level keys (``gradient_clipping``) override."""
    if mechanism.batch % world_size:
        raise ValueError(f"batch {mechanism.batch} does not split over {world_size} ranks")
    config = {
        "train_micro_batch_size_per_gpu": mechanism.batch // world_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        **extra,
    }
    if block is not None:
        config["layer_grad_norms"] = block
    return config


class StepHooks:
    """Where a benchmark acts on a step; the defaults do nothing. ``before_backward`` returns the loss to
    backpropagate (scale it for a gradient outlier of every layer; a hook registered on a parameter's gradient here
    must be removed in ``after_step``); ``after_step`` runs after ``engine.step()``."""

    def before_backward(self, step: int, engine, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def after_step(self, step: int, engine) -> None:
        return None


def bucket_of(name: str) -> str:
    """The ground truth's bucket of a parameter (``LAYER_NAME``): ``"0"``, ``"1"``, ``"embedding"``, ``"head"``."""
    match = LAYER_NAME.match(name)
    return match.group(1) if match else name.rpartition(".")[0] or name


def bucket_norms(tensors: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """The float64 L2 norm of each bucket's parameters' tensors (named as the parameters)."""
    squares: Dict[str, float] = {}
    for name, tensor in tensors.items():
        bucket = bucket_of(name)
        squares[bucket] = squares.get(bucket, 0.0) + tensor.detach().double().pow(2).sum().item()
    return {bucket: math.sqrt(total) for bucket, total in squares.items()}


class GroundTruth:
    """Every bucket's float64 norm of each signal, every step, computed beside DeepSpeed, not by the package: the
    gradient of each parameter kept by a tensor hook during backward (this rank's, before DeepSpeed reduces it),
    averaged over the ranks in one all-reduce (the pre-clip gradient DeepSpeed steps with); Adam's moments
    recomputed from it in float64 by Adam's recurrences (a plain-PyTorch reference of the moments: exact where
    every step is applied, i.e. without clipping or skipped steps); the update as the model's weights after the
    step minus before (weight decay included). Collective: every rank calls ``before_step``; rank 0 writes one
    JSON line per step to ``path``."""

    def __init__(self, engine, path: Optional[str], betas: Tuple[float, float]) -> None:
        self.named = [(name, param) for name, param in engine.module.named_parameters() if param.requires_grad]
        self.betas = betas
        self.out = open(path, "w", encoding="utf-8") if path else None
        self.grads: Dict[str, torch.Tensor] = {}
        self.handles = [param.register_hook(self._keeper(name)) for name, param in self.named]
        self.moments = {kind: {name: torch.zeros(param.shape, dtype=torch.float64) for name, param in self.named}
                        for kind in ("exp_avg", "exp_avg_sq")}
        self.line: Dict[str, Any] = {}
        self.before: Dict[str, torch.Tensor] = {}

    def _keeper(self, name: str):
        def keep(grad: torch.Tensor) -> None:
            self.grads[name] = grad.detach().double() + self.grads.get(name, 0.0)

        return keep

    def before_step(self, step: int, loss: float) -> None:
        """The step's gradient, averaged over the ranks, and the moments it makes (between backward and step)."""
        from deepspeed import comm as dist

        flat = torch.cat([self.grads[name].flatten() for name, _ in self.named])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        grads = {name: part.view(param.shape) for (name, param), part in
                 zip(self.named, flat.split([param.numel() for _, param in self.named]))}
        self.grads.clear()
        beta1, beta2 = self.betas
        for name, grad in grads.items():
            self.moments["exp_avg"][name].mul_(beta1).add_(grad, alpha=1 - beta1)
            self.moments["exp_avg_sq"][name].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        self.before = {name: param.detach().double().clone() for name, param in self.named}
        self.line = {"step": step, "loss": loss, "grad": bucket_norms(grads),
                     **{kind: bucket_norms(state) for kind, state in self.moments.items()}}

    def after_step(self) -> None:
        """The weights and the update; the step's line written."""
        after = {name: param.detach().double() for name, param in self.named}
        self.line["param"] = bucket_norms(after)
        self.line["update"] = bucket_norms({name: after[name] - self.before[name] for name in after})
        if self.out is not None:
            self.out.write(json.dumps(self.line) + "\n")

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        if self.out is not None:
            self.out.close()


@dataclass
class RunSpec:
    """One run of a launch: a mechanism at a seed, written under ``outdir`` (``dump.jsonl``, ``truth.jsonl``,
    ``record.json``, ``tb/``); ``block_extra`` and ``config_extra`` go into the feature's block and the top of the
    ds_config; ``feature`` False trains without the block (a baseline)."""

    mechanism: Mechanism
    seed: int
    outdir: str
    steps: Optional[int] = None
    truth: bool = True
    tensorboard: bool = False
    feature: bool = True
    eval_every: int = 50
    trigger: Optional[Dict[str, Any]] = None
    block_extra: Dict[str, Any] = field(default_factory=dict)
    config_extra: Dict[str, Any] = field(default_factory=dict)


def averaged_loss(loss: torch.Tensor) -> float:
    """The loss averaged over the ranks (each rank's share of the batch is equal): the global batch's loss."""
    from deepspeed import comm as dist

    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train(spec: RunSpec, hooks: Optional[StepHooks] = None) -> Dict[str, Any]:
    """One run on this rank (every rank of the launch calls it); returns the run's record (rank 0's is complete):
    per-step loss and global gradient norm, held-out accuracy every ``eval_every`` steps, the trigger's fires,
    whether ``skip_step`` skipped each step, seconds."""
    import deepspeed
    from deepspeed import comm as dist

    from megatron_integration.training_log import log_layer_grad_norms

    hooks = hooks or StepHooks()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.makedirs(spec.outdir, exist_ok=True)
    mechanism = spec.mechanism
    data = split(mechanism, spec.seed)
    model = build_model(mechanism, spec.seed)
    dump = os.path.join(spec.outdir, "dump.jsonl")
    block = feature_block(dump, spec.trigger, **spec.block_extra) if spec.feature else None
    engine, *_ = deepspeed.initialize(model=model, optimizer=build_optimizer(mechanism, model),
                                      config=ds_config(mechanism, world_size, block, **spec.config_extra))
    truth = None
    if spec.truth:
        truth = GroundTruth(engine, os.path.join(spec.outdir, "truth.jsonl") if rank == 0 else None, mechanism.betas)
    writer = tensorboard_writer(spec, rank, world_size)
    args = _log_args()
    batches = Batches(data, mechanism, spec.seed)
    record: Dict[str, Any] = {"spec": _spec_json(spec), "loss": [], "grad_norm": [], "skipped": [], "accuracy": []}
    started = time.time()
    for step in range(1, (spec.steps or mechanism.steps) + 1):
        x, y = shard(batches.next(), rank, world_size)
        loss = hooks.before_backward(step, engine, F.cross_entropy(engine(x), y))
        engine.backward(loss)
        reported = averaged_loss(loss)
        if spec.feature:
            engine.layer_grad_norms.report_loss(reported)
        if truth is not None:
            truth.before_step(step, reported)
        engine.step()
        if truth is not None:
            truth.after_step()
        hooks.after_step(step, engine)
        if spec.feature:
            log_layer_grad_norms(engine, step, writer, args)
        _record_step(record, engine, step, reported, spec.feature)
        if rank == 0 and (step % spec.eval_every == 0 or step == 1):
            record["accuracy"].append((step, accuracy(engine.module, data.test_x, data.test_y)))
    record["seconds"] = time.time() - started
    record["fires"] = sorted(engine.get_layer_grad_norms_history("all") or {}) if spec.feature else []
    _close(truth, writer, engine)
    if rank == 0:
        with open(os.path.join(spec.outdir, "record.json"), "w", encoding="utf-8") as out:
            json.dump(record, out)
    return record


def tensorboard_writer(spec: RunSpec, rank: int, world_size: int):
    """The Megatron hook's writer (under ``outdir/tb``) on the last rank, as Megatron's; ``None`` elsewhere."""
    if not (spec.tensorboard and spec.feature and rank == world_size - 1):
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(os.path.join(spec.outdir, "tb"))


def _log_args():
    import argparse

    return argparse.Namespace(log_layer_grad_norms=True, log_interval=10**9)


def _spec_json(spec: RunSpec) -> Dict[str, Any]:
    return {**asdict(replace(spec, mechanism=None)), "mechanism": asdict(spec.mechanism)}


def _record_step(record: Dict[str, Any], engine, step: int, loss: float, feature: bool) -> None:
    record["loss"].append(loss)
    norm = engine.get_global_grad_norm()
    record["grad_norm"].append(float("nan") if norm is None else float(norm))
    result = engine.get_layer_grad_norms() if feature else None
    record["skipped"].append(bool(result and result.get("step") == step and result.get("skipped")))


def _close(truth: Optional[GroundTruth], writer, engine) -> None:
    if truth is not None:
        truth.close()
    if writer is not None:
        writer.close()
    engine.destroy()


def train_all(specs: List[RunSpec]) -> List[Optional[Dict[str, Any]]]:
    """Every run in one launch, in order (``train``); each rank's records, a failed run's an ``error``."""
    import logging
    import traceback

    import deepspeed_patch

    deepspeed_patch.install()
    torch.set_num_threads(1)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    records = []
    for spec in specs:
        try:
            records.append(train(spec))
        except Exception:
            records.append({"spec": _spec_json(spec), "error": traceback.format_exc()})
    return records


# ---------------------------------------------------------------- plain PyTorch (probes)


def train_plain(mechanism: Mechanism, seed: int, steps: Optional[int] = None,
                eval_every: int = 50) -> Dict[str, List]:
    """The same run in plain PyTorch on one process (the whole global batch): per-step loss and global gradient
    norm, held-out accuracy every ``eval_every`` steps. For probing which settings spike, quickly."""
    data = split(mechanism, seed)
    model = build_model(mechanism, seed)
    optimizer = build_optimizer(mechanism, model)
    batches = Batches(data, mechanism, seed)
    record: Dict[str, List] = {"loss": [], "grad_norm": [], "accuracy": []}
    for step in range(1, (steps or mechanism.steps) + 1):
        x, y = batches.next()
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        record["grad_norm"].append(math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters())))
        optimizer.step()
        record["loss"].append(loss.item())
        if step % eval_every == 0:
            record["accuracy"].append((step, accuracy(model, data.test_x, data.test_y)))
    return record
