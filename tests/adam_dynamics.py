"""Real Adam dynamics with a known cause: a TinyGPT trained by ``torch.optim.AdamW`` (or ``Adam``), every step's
per-layer norm of each signal the spike rules judge (``megatron_integration.spike``), read from the model and the
optimizer's own state.

The series are coupled as in a run: the injected gradient goes through the optimizer's moments into the update, the
update moves the weights, and the next step's gradient follows from them. ``benchmarks/adam_dynamics.py`` measures
the rules' table on them (docs/spikes.md); ``tests/test_spike.py`` judges fires built from them.
"""

import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from deepspeed_patch.outputs.tags import UPDATE_TO_WEIGHT
from megatron_integration.fires import Fire
from megatron_integration.tiny_gpt import TinyGPT, TinyGPTConfig, synthetic_batch

Series = Dict[str, Dict[int, List[Tuple[int, float]]]]
"""``series[signal][layer]``: ``(step, norm)`` in step order, as ``Fire.series``."""
KINDS = ("param", "update", "exp_avg", "exp_avg_sq")
_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass(frozen=True)
class Cause:
    """What is injected: ``"gradient"``, the gradient of ``layer`` (``None``: of every layer) times ``factor`` at
    ``step``; ``"lr"``, the learning rate times ``factor`` from ``step`` for ``steps`` steps; ``"none"``."""

    kind: str = "none"
    step: int = 0
    factor: float = 1.0
    layer: Optional[int] = None
    steps: int = 1


@dataclass(frozen=True)
class Run:
    """The training run the cause is injected into."""

    steps: int = 120
    layers: int = 4
    optimizer: str = "adamw"
    betas: Tuple[float, float] = (0.9, 0.999)
    lr: float = 1e-3
    clip: Optional[float] = None
    """``clip_grad_norm_``'s max norm, or ``None``: no clipping."""
    seed: int = 0


def train(cause: Cause, run: Run = Run()) -> Series:
    """Train ``run`` with ``cause``; every signal of every layer at every step: the pre-clip gradient, and after
    the optimizer's step the weights, the update (after minus before), the moments and the update-to-weight
    ratio. One thread: a model this small only loses time to more (on a shared machine, much)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(cause, run)
    finally:
        torch.set_num_threads(threads)


def _train(cause: Cause, run: Run) -> Series:
    torch.manual_seed(run.seed)
    config = TinyGPTConfig(vocab_size=64, seq_len=16, hidden=32, num_layers=run.layers, num_heads=4)
    model = TinyGPT(config)
    layer_of = {param: int(match.group(1)) for name, param in model.named_parameters()
                if (match := _LAYER.match(name))}
    optimizers = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}
    optimizer = optimizers[run.optimizer](model.parameters(), lr=run.lr, betas=run.betas)
    series: Series = {}
    for step in range(1, run.steps + 1):
        model.zero_grad()
        model(synthetic_batch(config, 8, seed=step)).backward()
        if cause.kind == "gradient" and step == cause.step:
            for param, layer in layer_of.items():
                if cause.layer in (None, layer):
                    param.grad.mul_(cause.factor)
        _record(series, step, "pre_clip", _norms(layer_of, lambda param: param.grad))
        if run.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), run.clip)
        before = {param: param.detach().clone() for param in layer_of}
        lr_factor = cause.factor if cause.kind == "lr" and cause.step <= step < cause.step + cause.steps else 1.0
        for group in optimizer.param_groups:
            group["lr"] = run.lr * lr_factor
        optimizer.step()
        norms = _after_step(layer_of, before, optimizer.state)
        for kind, values in norms.items():
            _record(series, step, kind, values)
        _record(series, step, UPDATE_TO_WEIGHT,
                {layer: norms["update"][layer] / norms["param"][layer] for layer in norms["param"]})
    return series


def _after_step(layer_of: Dict, before: Dict, state: Dict) -> Dict[str, Dict[int, float]]:
    """Each layer's norm of the weights, the update (after minus before) and the moments, after a step."""
    kinds = {"param": lambda param: param.detach(), "update": lambda param: param.detach() - before[param],
             "exp_avg": lambda param: state[param]["exp_avg"], "exp_avg_sq": lambda param: state[param]["exp_avg_sq"]}
    return {kind: _norms(layer_of, read) for kind, read in kinds.items()}


def _norms(layer_of: Dict, read) -> Dict[int, float]:
    squares: Dict[int, float] = {}
    for param, layer in layer_of.items():
        squares[layer] = squares.get(layer, 0.0) + float(read(param).double().pow(2).sum())
    return {layer: math.sqrt(square) for layer, square in squares.items()}


def _record(series: Series, step: int, signal: str, values: Dict[int, float]) -> None:
    for layer, value in values.items():
        series.setdefault(signal, {}).setdefault(layer, []).append((step, value))


def fire_of(series: Series, fired_at: int, history: int = 8, before: str = "interval", interval: int = 1) -> Fire:
    """The fire at ``fired_at`` a log of ``series`` would hold: its last ``history`` steps recorded, and before
    them ``before``: ``"interval"``, the steps measured every ``interval``; ``"recorder"``, the recorder's
    blocks of ``history`` steps (root mean square, ``deepspeed_patch.spikes.recorder``), at most 8; ``"none"``."""
    start = fired_at - history + 1
    fire = Fire(fired_at, "injected", {signal: {layer: [(step, value) for step, value in points
                                                        if start <= step <= fired_at]
                                                for layer, points in layers.items()}
                                       for signal, layers in series.items() if signal != "param"})
    for signal, layers in series.items():
        for layer, points in layers.items():
            earlier = [(step, value) for step, value in points if step < start]
            if before == "interval":
                fire.interval.setdefault(signal, {})[layer] = [(s, v) for s, v in earlier if s % interval == 0]
            elif before == "recorder":
                fire.blocks.setdefault(signal, {})[layer] = _blocks(earlier, history)
    return fire


def _blocks(earlier: List[Tuple[int, float]], size: int) -> List[Tuple[int, int, float]]:
    """The recorder's blocks of ``earlier``: ``size`` steps each from the first, the last one open, the last 8."""
    blocks = []
    for start in range(0, len(earlier), size):
        chunk = earlier[start:start + size]
        blocks.append((chunk[0][0], chunk[-1][0], math.sqrt(sum(value**2 for _, value in chunk) / len(chunk))))
    return blocks[-8:]
