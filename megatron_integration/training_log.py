"""Per-layer gradient norms in Megatron's training log and TensorBoard.

``log_layer_grad_norms`` is called once per iteration from the training loop. On iterations the
statistics were measured it writes, on the rank that owns the TensorBoard writer, one scalar per
layer, phase (pre-/post-clip) and statistic, against iteration and, as the forks do for their other
scalars, also "vs samples" and "vs tokens"; and it returns a compact field for the stdout log line.
On other iterations it returns at once: no collective, no work.
"""

import argparse
import re
from typing import Dict, Hashable, Iterable, List, Optional

from deepspeed_patch.layer_map import bucket_label

from .arguments import layer_grad_norms_interval

PHASES = ("pre_clip", "post_clip")
STATISTICS = ("norm", "min", "max")
TAG_ROOT = "layer-grad-norms"


def scalar_tag(phase: str, statistic: str, key: Hashable) -> str:
    return f"{TAG_ROOT}/{phase.replace('_', '-')}/{statistic}/{bucket_label(key)}"


def parameter_family(key: Hashable) -> Optional[str]:
    """What a finer bucket is, whatever its layer: ``mlp.fc2.weight`` for ``layers.3.mlp.fc2.weight``."""
    match = re.search(r"(?:^|\.)\d+\.(.+)$", key) if isinstance(key, str) else None
    return match.group(1) if match else None


def custom_scalars_layout(keys: Iterable[Hashable] = ()) -> Dict[str, Dict[str, List]]:
    """One multi-line chart per phase and statistic where the selected layers share it (NormFormer's
    figure); with per-parameter or group_by buckets, one more chart per parameter family."""
    layout = {}
    for phase in PHASES:
        tag_phase = phase.replace("_", "-")
        layout[f"{TAG_ROOT} {tag_phase}"] = {
            statistic: ["Multiline", [rf"^{TAG_ROOT}/{tag_phase}/{statistic}/layer\d+$"]] for statistic in STATISTICS
        }
        for family in sorted({parameter_family(key) for key in keys} - {None}):
            layout[f"{TAG_ROOT} {tag_phase}: {family}"] = {
                statistic: ["Multiline", [rf"^{TAG_ROOT}/{tag_phase}/{statistic}/(.*\.)?\d+\.{re.escape(family)}$"]]
                for statistic in STATISTICS
            }
    return layout


def write_tensorboard(writer, stats: Dict, iteration: int, args: argparse.Namespace) -> None:
    """Every selected bucket's statistics, against iteration, samples and (where counted) tokens."""
    if not getattr(writer, "_layer_grad_norms_layout", False):
        writer.add_custom_scalars(custom_scalars_layout(stats["pre_clip"]))
        writer._layer_grad_norms_layout = True
    axes = [("", iteration)]
    if getattr(args, "consumed_train_samples", None) is not None:
        axes.append((" vs samples", args.consumed_train_samples))
    if getattr(args, "consumed_train_tokens", None) is not None:
        axes.append((" vs tokens", args.consumed_train_tokens))
    for phase in PHASES:
        for key, values in (stats[phase] or {}).items():
            for statistic in STATISTICS:
                for suffix, step in axes:
                    writer.add_scalar(scalar_tag(phase, statistic, key) + suffix, values[statistic], step)


def log_string_field(stats: Dict) -> str:
    """`` layer grad norm: 0: 3.1E-01 | 1: 2.9E-01 | ... |`` for the layers, pre-clip."""
    layers = [(key, values["norm"]) for key, values in stats["pre_clip"].items() if isinstance(key, int)]
    return " layer grad norm:" + "".join(f" {key}: {norm:.3E} |" for key, norm in layers)


def log_layer_grad_norms(engine, iteration: int, writer, args: argparse.Namespace) -> str:
    """Log this iteration's per-layer statistics, if it was measured; returns the log-line field.

    ``engine`` is the DeepSpeed engine, ``writer`` the TensorBoard writer (``None`` on ranks without
    one). The field is returned on ``args.log_interval`` iterations, else ``''``.
    """
    if not getattr(args, "log_layer_grad_norms", False) or iteration % layer_grad_norms_interval(args):
        return ""
    stats = engine.get_layer_grad_norms()
    if stats is None or stats["step"] != iteration:
        return ""
    if writer is not None:
        write_tensorboard(writer, stats, iteration, args)
    if iteration % getattr(args, "log_interval", 1):
        return ""
    return log_string_field(stats)
