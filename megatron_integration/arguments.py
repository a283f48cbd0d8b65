"""Megatron-style command-line flags for per-layer gradient norms, and the ds_config they fill.

``add_layer_grad_norms_args`` works as an ``extra_args_provider`` or inside ``parse_args``;
``layer_grad_norms_ds_config`` turns the flags into the ``layer_grad_norms`` block, so no JSON edit
is needed. A block already in the user's ds_config wins, with a warning when the two disagree.
"""

import argparse
import copy
import json
import logging
from typing import Any, Dict, List, Optional, Union

from pydantic import ValidationError

import deepspeed_patch
from deepspeed_patch.config import CONFIG_KEY, AdaptiveClippingConfig, SkipStepConfig, parse_layer_spec
from deepspeed_patch.tags import OPTIMIZER_KINDS

logger = logging.getLogger(__name__)

DEFAULT_LAYERS = "0,1,mid,-2,-1"  # the five layers of the NormFormer paper's figure
LAYER_FLAG_FORMS = ('"all" or a comma-separated list such as 0,1,mid,-2,-1 (negative indices count from the last '
                    'layer, mid is L // 2)')
"""What a command-line flag takes for a layer selection: the string form of the ds_config's ``layers``."""


def add_layer_grad_norms_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the "layer grad norms" argument group to a Megatron argument parser."""
    flags = parser.add_argument_group(title="layer grad norms")
    flags.add_argument("--log-layer-grad-norms", action="store_true",
                       help="Log per-layer gradient norm, min and max (pre- and post-clip) to TensorBoard "
                       "and the training log.")
    flags.add_argument("--layer-grad-norms-layers", type=str, default=DEFAULT_LAYERS,
                       help=f"Layers to log: {LAYER_FLAG_FORMS} (default: {DEFAULT_LAYERS}).")
    flags.add_argument("--layer-grad-norms-interval", type=int, default=None,
                       help="Measure every N iterations (default: --tensorboard-log-interval).")
    flags.add_argument("--layer-grad-norms-trigger", type=float, default=None, metavar="FACTOR",
                       help="Capture every layer after a spike: the global gradient norm or the reported loss "
                       "above FACTOR x its running median, or an fp16 overflow (trigger.grad_norm_factor and "
                       "trigger.loss_factor).")
    flags.add_argument("--layer-grad-norms-history", type=int, default=None, metavar="K",
                       help="Record every layer's statistics of the last K steps, reduced when the trigger "
                       "fires (trigger.history; with the default trigger unless --layer-grad-norms-trigger).")
    flags.add_argument("--layer-grad-norms-optimizer-statistics", type=str, default=None, metavar="KINDS",
                       help=f"Also log what each measured optimizer step did to each layer: a comma-separated "
                       f"list of {','.join(OPTIMIZER_KINDS)} (the fp32 weights, the step's update, the Adam "
                       "moments; with param and update, their norms' ratio update-to-weight too); the ds_config's "
                       "optimizer_statistics.")
    flags.add_argument("--layer-grad-norms-adaptive-clipping", type=str, nargs="?", const="", default=None,
                       metavar="KEY=VALUE,...",
                       help="Clip each layer's gradient against the moving average of its own clipped norm (AdaGC) "
                       "after a warm-up of global clipping; optional settings such as beta=0.98,factor=1.05,"
                       "warmup_steps=100 (the ds_config's adaptive_clipping). Every step is then measured.")
    flags.add_argument("--layer-grad-norms-skip-step", type=str, nargs="?", const="", default=None,
                       metavar="KEY=VALUE,...",
                       help="Skip an optimizer step whose global gradient norm is more than sigma standard "
                       "deviations above its last window steps' mean; optional settings such as sigma=6,window=128 "
                       "(the ds_config's skip_step). Every step is then measured.")
    return parser


def layer_grad_norms_interval(args: argparse.Namespace) -> int:
    """The measuring interval: the flag, else the TensorBoard log interval, else every iteration."""
    return args.layer_grad_norms_interval or getattr(args, "tensorboard_log_interval", None) or 1


def layer_grad_norms_block(args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """The ``layer_grad_norms`` ds_config block the flags ask for; ``None`` without them. A remedy's flag alone
    gives a block that acts without logging: ``enabled`` (the block's master switch) is on, and the training-log
    hook writes nothing without ``--log-layer-grad-norms``."""
    remedies = _remedy_blocks(args)
    if not getattr(args, "log_layer_grad_norms", False):
        return {"enabled": True, **remedies} if remedies else None
    try:
        parse_layer_spec(args.layer_grad_norms_layers)
    except ValueError as err:
        raise ValueError(f"--layer-grad-norms-layers={args.layer_grad_norms_layers!r}: {err}") from None
    if args.layer_grad_norms_interval is not None and args.layer_grad_norms_interval < 1:
        raise ValueError(f"--layer-grad-norms-interval={args.layer_grad_norms_interval}: must be 1 or more")
    block = {"enabled": True, "layers": args.layer_grad_norms_layers, "interval": layer_grad_norms_interval(args)}
    trigger = _trigger_block(args)
    if trigger is not None:
        block["trigger"] = trigger
    kinds = _optimizer_statistics(args)
    if kinds:
        block["optimizer_statistics"] = kinds
    return {**block, **remedies}


REMEDY_FLAGS = {
    "adaptive_clipping": ("--layer-grad-norms-adaptive-clipping", AdaptiveClippingConfig),
    "skip_step": ("--layer-grad-norms-skip-step", SkipStepConfig),
}
"""Each remedy's ds_config key: its flag, and the model that checks the flag's settings."""


def _remedy_blocks(args: argparse.Namespace) -> Dict[str, Dict[str, Any]]:
    """The ``adaptive_clipping`` and ``skip_step`` blocks of their flags (``KEY=VALUE,...``, or nothing for the
    defaults), checked; none for a flag not given."""
    blocks = {}
    for key, (flag, model) in REMEDY_FLAGS.items():
        value = getattr(args, flag.removeprefix("--").replace("-", "_"), None)
        if value is None:
            continue
        settings: Dict[str, Any] = {"enabled": True}
        for item in filter(None, (part.strip() for part in value.split(","))):
            name, equals, number = item.partition("=")
            if not equals or name.strip() not in model.model_fields or name.strip() == "enabled":
                raise ValueError(f"{flag}={value!r}: {item!r} is not one of "
                                 f"{', '.join(f'{field}=...' for field in model.model_fields if field != 'enabled')}")
            settings[name.strip()] = _number(number.strip())
        try:
            model(**settings)
        except ValidationError as err:
            raise ValueError(f"{flag}={value!r}: {err.errors()[0]['msg']}") from None
        blocks[key] = settings
    return blocks


def _number(text: str) -> Union[int, float, str]:
    """A flag setting's value as the JSON of a ds_config would have it: an int, a float, or (left to the check)
    the text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _optimizer_statistics(args: argparse.Namespace) -> List[str]:
    """The kinds ``--layer-grad-norms-optimizer-statistics`` lists, checked; none without the flag."""
    flag = getattr(args, "layer_grad_norms_optimizer_statistics", None)
    if flag is None:
        return []
    kinds = [kind.strip() for kind in flag.split(",")]
    unknown = [kind for kind in kinds if kind not in OPTIMIZER_KINDS]
    if unknown:
        raise ValueError(f"--layer-grad-norms-optimizer-statistics={flag!r}: {unknown[0]!r} is not a kind; choose "
                         f"from {', '.join(OPTIMIZER_KINDS)}")
    return kinds


def _trigger_block(args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """The ``trigger`` block of ``--layer-grad-norms-trigger`` and ``--layer-grad-norms-history``, or ``None``."""
    factor = getattr(args, "layer_grad_norms_trigger", None)
    history = getattr(args, "layer_grad_norms_history", None)
    if factor is None and history is None:
        return None
    trigger: Dict[str, Any] = {}
    if factor is not None:
        if not factor > 1:
            raise ValueError(f"--layer-grad-norms-trigger={factor}: must be more than 1 (a multiple of the median)")
        trigger.update(grad_norm_factor=factor, loss_factor=factor)
    if history is not None:
        if history < 0:
            raise ValueError(f"--layer-grad-norms-history={history}: must be 0 (off) or more")
        trigger["history"] = history
    return trigger


def layer_grad_norms_ds_config(args: argparse.Namespace,
                               ds_config: Union[Dict[str, Any], str, None] = None) -> Optional[Dict[str, Any]]:
    """The ds_config to initialize DeepSpeed with, its ``layer_grad_norms`` block filled from the flags.

    ``ds_config`` is a dict, a path to the JSON file, or ``None`` for ``args.deepspeed_config``.
    Without ``--log-layer-grad-norms`` the config comes back unchanged (a dict, or the path as given).
    With it, ``deepspeed_patch.install()`` runs first (idempotent): the forks call this right before
    ``deepspeed.initialize``, so the flag alone gives the engine ``get_layer_grad_norms()``.
    """
    if ds_config is None:
        ds_config = getattr(args, "deepspeed_config_dict", None) or getattr(args, "deepspeed_config", None)
    block = layer_grad_norms_block(args)
    if block is None:
        return ds_config
    deepspeed_patch.install()
    if isinstance(ds_config, str):
        with open(ds_config) as config_file:
            ds_config = json.load(config_file)
    config = copy.deepcopy(ds_config) if ds_config else {}
    existing = config.get(CONFIG_KEY)
    if existing is None:
        config[CONFIG_KEY] = block
    elif any(key in existing and existing[key] != value for key, value in block.items()):
        logger.warning("the ds_config block %s=%s wins over the command-line flags (%s)", CONFIG_KEY, existing, block)
    return config
