"""The demo: train the tiny GPT under ZeRO on CPU ranks and log per-layer gradient norms.

It logs through the same training-log hook a Megatron run uses, then draws the figure and writes
the report, answering the NormFormer question for this small run: under Pre-LN, are the gradients
of the early layers larger than those of the late layers?

With a spike (``--spike STEP:LAYER``) the run records every layer's last ``SPIKE_HISTORY`` steps
(``trigger.history``), and at step STEP a loss term on one layer's parameters multiplies that layer's
gradient, and so the global gradient norm, far past the trigger's factor: the trigger fires, the hook writes
the recorded steps, and the report and a second figure show which layer rose, and when.

With a learning-rate spike (``--lr-spike STEP``) the learning rate is ``LR_SPIKE`` times larger at step STEP
only: every layer's update leaves its median there, and the next step's gradients rise from the weights it moved.
Either spike turns on the optimizer's statistics (``optimizer_statistics``: weights, update, moments) and the
JSONL dump, and the report says which signal of which layer left its median first: the gradient for ``--spike``,
the update for ``--lr-spike``.

With a remedy (``--remedy adaptive`` or ``skip``) the run turns it on (``DEMO_REMEDIES``' settings: a warm-up or
window short enough for the demo's steps) and writes the JSONL dump; the report's remedy section and the figure's
markers and factor panel show what it did. With ``--spike`` too, ``skip`` skips the spiking step; the optimizer's
statistics stay off (a remedy and ``optimizer_statistics`` are not combined).
"""

import argparse
import contextlib
import math
import os
import shutil
import threading
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import nn
from tqdm import tqdm

from deepspeed_patch.config import CONFIG_KEY
from deepspeed_patch.outputs.tags import OPTIMIZER_KINDS

from .arguments import DEFAULT_LAYERS, layer_grad_norms_ds_config
from .cpu_launch import launch
from .fires import read_fires
from .log_sources import dump_files
from .plot import plot_layer_norms, plot_spike_history
from .remedy_report import RemedyLog, read_remedies, remedy_section
from .report import format_report, summarize
from .run_scalars import GLOBAL_NORM_TAGS, LOSS_TAGS, read_run_scalars
from .spike import localise_all, spiked_layers
from .tensorboard_reader import read_layer_series
from .tiny_gpt import TinyGPT, TinyGPTConfig, synthetic_batch
from .training_log import log_layer_grad_norms


@dataclass
class DemoOptions:
    steps: int = 200
    num_layers: int = 12
    hidden: int = 64
    zero_stage: int = 2
    world_size: int = 2
    arch: str = "preln"
    layers: str = DEFAULT_LAYERS  # the NormFormer figure's five: 0, 1, mid, -2, -1
    micro_batch: int = 8
    out: str = "runs/demo"
    spike: Optional[Tuple[int, int]] = None
    """``(step, layer)``: inject a gradient spike into that layer at that step, with a flight recorder on."""
    lr_spike: Optional[int] = None
    """A step whose learning rate is ``LR_SPIKE`` x the others', with a flight recorder on."""
    remedy: Optional[str] = None
    """A remedy to turn on: a key of ``DEMO_REMEDIES``."""

    @property
    def recording(self) -> bool:
        """Whether a spike is injected: the run records its last steps, with the optimizer's statistics."""
        return self.spike is not None or self.lr_spike is not None


SPIKE_HISTORY = 8
"""The recorded steps of the demo with a spike (``trigger.history``)."""
SPIKE_SIZE = 30.0
"""The injected gradient's norm, in multiples of the previous step's global gradient norm: far past the
trigger's factor (3 by default)."""
LR_SPIKE = 3000.0
"""The learning rate's factor at ``--lr-spike``'s step: every layer's update leaves its median at that step, and
the weights it moves raise the next step's gradient past the trigger's factor."""
DEMO_REMEDIES = {"adaptive": ("layer_grad_norms_adaptive_clipping", "warmup_steps=20"),
                 "skip": ("layer_grad_norms_skip_step", "window=20")}
"""``--remedy``'s choices: the Megatron flag's attribute that turns the remedy on, and its settings (judged after
20 steps, where the defaults wait 100 and 64: the demo runs 200)."""
DUMP = "layer_grad_norms.jsonl"
"""The JSONL dump of a run with a spike, in ``--out``: every measured step's full result, and the recorded steps
of each fire with the optimizer's statistics of every layer."""


def megatron_style_args(options: DemoOptions) -> argparse.Namespace:
    """The arguments a Megatron run with ``--log-layer-grad-norms`` would have (and
    ``--layer-grad-norms-history`` with a spike)."""
    args = argparse.Namespace(log_layer_grad_norms=True, layer_grad_norms_layers=options.layers,
                              layer_grad_norms_interval=1, tensorboard_log_interval=1,
                              layer_grad_norms_history=SPIKE_HISTORY if options.recording else None,
                              log_interval=max(1, options.steps // 10), consumed_train_samples=0)
    if options.remedy is not None:
        flag, settings = DEMO_REMEDIES[options.remedy]
        setattr(args, flag, settings)
    return args


def spike_term(layer: nn.Module, norm: float) -> torch.Tensor:
    """A loss term whose gradient is, on every parameter of ``layer``, the same value, of L2 norm ``norm``
    over the layer; nothing elsewhere."""
    params = [param for param in layer.parameters() if param.requires_grad]
    return norm / math.sqrt(sum(param.numel() for param in params)) * sum(param.sum() for param in params)


def injected_spike(engine, options: DemoOptions, step: int) -> torch.Tensor:
    """The loss term of the demo's spike at ``step`` (zero at other steps): ``SPIKE_SIZE`` x the last
    global gradient norm, on the chosen layer."""
    if options.spike is None or step != options.spike[0]:
        return torch.zeros(())
    last_norm = engine.get_global_grad_norm()
    return spike_term(engine.module.layers[options.spike[1]], SPIKE_SIZE * float(last_norm or 1.0))


def demo_ds_config(options: DemoOptions, args: argparse.Namespace) -> dict:
    """The ds_config of the demo's engine: its ``layer_grad_norms`` block from ``args``, and with a spike the
    optimizer's statistics of every kind (not with a remedy) and the dump (``DUMP``), which a remedy writes too."""
    config = layer_grad_norms_ds_config(args, {
        "train_micro_batch_size_per_gpu": options.micro_batch,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": options.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    })
    if options.recording and options.remedy is None:
        config[CONFIG_KEY]["optimizer_statistics"] = list(OPTIMIZER_KINDS)
    if options.recording or options.remedy is not None:
        config[CONFIG_KEY]["dump"] = {"path": os.path.join(options.out, DUMP)}
    return config


@contextlib.contextmanager
def learning_rate_times(optimizer, factor: float):
    """Every parameter group's learning rate ``factor`` times its own inside the block, restored after it."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] *= factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr


def train_rank(options: DemoOptions) -> None:
    """One rank's training loop; the last rank writes TensorBoard and prints the progress lines."""
    import deepspeed
    from deepspeed import comm as dist
    from torch.utils.tensorboard import SummaryWriter

    import deepspeed_patch

    deepspeed_patch.install()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model_config = TinyGPTConfig(vocab_size=256, seq_len=32, hidden=options.hidden, num_layers=options.num_layers,
                                 num_heads=4, pre_ln=options.arch == "preln")
    torch.manual_seed(0)
    model = TinyGPT(model_config)
    args = megatron_style_args(options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=demo_ds_config(options, args))
    last_rank = rank == world_size - 1
    writer = SummaryWriter(os.path.join(options.out, "tensorboard")) if last_rank else None
    # A thread lock: tqdm's default, a multiprocessing lock, is left registered with the resource tracker when the
    # launcher stops this rank (Ctrl-C), which then warns of a leaked semaphore at exit.
    tqdm.set_lock(threading.RLock())
    # Drawn by the last rank, on a terminal only (``disable=None``): redirected, the log lines are the progress.
    progress = tqdm(total=options.steps, desc="demo", unit="step", disable=None if last_rank else True)
    for step in range(1, options.steps + 1):
        loss = engine(synthetic_batch(model_config, options.micro_batch, seed=step * world_size + rank))
        engine.backward(loss + injected_spike(engine, options, step))
        with learning_rate_times(engine.optimizer, LR_SPIKE if step == options.lr_spike else 1.0):
            engine.step()
        args.consumed_train_samples += options.micro_batch * world_size
        if writer is not None:
            write_run_scalars(writer, step, loss.item(), engine.get_global_grad_norm())
        field = log_layer_grad_norms(engine, step, writer, args)
        progress.update()
        progress.set_postfix(loss=f"{loss.item():.3f}")
        if last_rank and field:
            progress.write(f"iteration {step:>5}/{options.steps} | loss {loss.item():.3f} |{field}")
    progress.close()
    if writer is not None:
        writer.close()
    engine.destroy()


def write_run_scalars(writer, step: int, loss: float, global_norm) -> None:
    """The step's loss (the writing rank's) and global gradient norm (``None``: none computed), as Megatron names
    them in its TensorBoard (``lm loss``, ``grad-norm``): ``plot`` draws them under the per-layer norms."""
    writer.add_scalar(LOSS_TAGS[0], loss, step)
    if global_norm is not None:
        writer.add_scalar(GLOBAL_NORM_TAGS[0], float(global_norm), step)


def run_demo(options: DemoOptions) -> str:
    """Train, then write the figure and the report into ``options.out``; returns the report and paths.

    A previous demo's TensorBoard directory and dump in ``options.out`` are removed first: TensorBoard would draw
    both runs, each line going from the last step back to step 1, and the dump would append to the old lines.
    With a spike, the fires are read from the dump: it holds every layer's optimizer statistics of the recorded
    steps, and the update-to-weight ratio ``plot --history`` draws.
    """
    tensorboard_dir, dump = os.path.join(options.out, "tensorboard"), os.path.join(options.out, DUMP)
    if os.path.isdir(tensorboard_dir):
        shutil.rmtree(tensorboard_dir)
    for stale in dump_files(dump):
        if os.path.exists(stale):
            os.remove(stale)
    os.makedirs(options.out, exist_ok=True)  # the dump's directory, before rank 0 writes its first line
    launch(train_rank, options.world_size, options)
    series, fires = read_layer_series(tensorboard_dir), read_fires(dump) if options.recording else []
    remedies = read_remedies(dump) if options.remedy is not None else RemedyLog()
    spikes = localise_all(fires)
    summary = summarize(series, spikes=spikes)
    summary["spikes"] = spikes
    summary.update(remedy_section(remedies))
    figure = os.path.join(options.out, "layer_grad_norms.png")
    plot_layer_norms(series, figure, spiked_layers(summary["spikes"]), remedies, read_run_scalars(tensorboard_dir))
    dumped = options.recording or options.remedy is not None
    paths = f"dump: {dump}\nfigure: {figure}\n" if dumped else f"figure: {figure}\n"
    if fires:
        history_figure = os.path.join(options.out, "spike_history.png")
        plot_spike_history(fires, summary["spikes"], history_figure)
        paths += f"spike history: {history_figure}\n"
    report = format_report(summary)
    with open(os.path.join(options.out, "report.txt"), "w") as out:
        out.write(report + "\n")
    remedy = "" if options.remedy is None else f", remedy {options.remedy}"
    return (f"{report}\n\n({options.arch}, {options.num_layers} layers, hidden {options.hidden}, "
            f"ZeRO-{options.zero_stage}, {options.world_size} ranks{remedy})\n"
            f"TensorBoard: {tensorboard_dir}\n{paths}report: {os.path.join(options.out, 'report.txt')}")
