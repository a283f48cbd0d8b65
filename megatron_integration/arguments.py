"""Megatron-style command-line flags for per-layer gradient norms, and the ds_config they fill.

``add_layer_grad_norms_args`` works as an ``extra_args_provider`` or inside ``parse_args``;
``layer_grad_norms_ds_config`` turns the flags into the ``layer_grad_norms`` block, so no JSON edit
is needed. A block already in the user's ds_config wins, with a warning when the two disagree.
"""

import argparse
import copy
import functools
import json
import logging
import math
from typing import Any, Callable, Dict, Optional, Union

from pydantic import ValidationError

import deepspeed_patch
from deepspeed_patch.config import CONFIG_KEY, AdaptiveClippingConfig, SkipStepConfig, parse_layer_spec
from deepspeed_patch.outputs.tags import OPTIMIZER_KINDS

logger = logging.getLogger(__name__)

DEFAULT_LAYERS = "0,1,mid,-2,-1"  # the five layers of the NormFormer paper's figure
LAYER_FLAG_FORMS = ('"all" or a comma-separated list such as 0,1,mid,-2,-1 (negative indices count from the last '
                    'layer, mid is L // 2)')
"""What a command-line flag takes for a layer selection: the string form of the ds_config's ``layers``."""


def layer_selection(value: str) -> str:
    """A flag's layer selection (``LAYER_FLAG_FORMS``), checked; the text as given."""
    try:
        parse_layer_spec(value)
    except ValueError as err:
        reason = str(err).split("; expected")[0]
        raise argparse.ArgumentTypeError(f"{value!r}: {reason}; expected {LAYER_FLAG_FORMS}") from None
    return value


def positive_int(value: str) -> int:
    """An integer of 1 or more."""
    if not str(value).isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive integer")
    return int(value)


def _non_negative_int(value: str) -> int:
    if not str(value).isdigit():
        raise argparse.ArgumentTypeError(f"{value!r}: expected 0 (off) or a positive integer")
    return int(value)


def _trigger_factor(value: str) -> float:
    """The trigger's factor: a number above 1 (a multiple of the running median)."""
    try:
        factor = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not (math.isfinite(factor) and factor > 1):
        raise argparse.ArgumentTypeError(f"{value!r}: must be more than 1 (a multiple of the median)")
    return factor


def _optimizer_kinds(value: str) -> str:
    """A comma-separated list of ``OPTIMIZER_KINDS``, checked; the text as given."""
    unknown = [kind for kind in (kind.strip() for kind in value.split(",")) if kind not in OPTIMIZER_KINDS]
    if unknown:
        raise argparse.ArgumentTypeError(f"{value!r}: {unknown[0]!r} is not a kind; choose from "
                                         f"{', '.join(OPTIMIZER_KINDS)}")
    return value


def remedy_settings(model: type, value: str) -> Dict[str, Any]:
    """A remedy flag's ``KEY=VALUE,...`` (nothing: the defaults) as its ds_config block, checked by its model."""
    settings: Dict[str, Any] = {"enabled": True}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, equals, number = item.partition("=")
        if not equals or name.strip() not in model.model_fields or name.strip() == "enabled":
            known = ", ".join(f"{field}=..." for field in model.model_fields if field != "enabled")
            raise argparse.ArgumentTypeError(f"{value!r}: {item!r} is not one of {known}")
        settings[name.strip()] = _number(number.strip())
    try:
        model(**settings)
    except ValidationError as err:
        raise argparse.ArgumentTypeError(f"{value!r}: {err.errors()[0]['msg']}") from None
    return settings


def _remedy_type(model: type) -> Callable[[str], str]:
    def checked(value: str) -> str:
        remedy_settings(model, value)
        return value

    return checked


def add_layer_grad_norms_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the "layer grad norms" argument group to a Megatron argument parser. Each value is checked as the
    flags are parsed (argparse's one line naming the flag, exit code 2), not at ``deepspeed.initialize`` after
    the model is built."""
    flags = parser.add_argument_group(title="layer grad norms")
    flags.add_argument("--log-layer-grad-norms", action="store_true",
                       help="Log per-layer gradient norm, min and max (pre- and post-clip) to TensorBoard "
                       "and the training log.")
    flags.add_argument("--layer-grad-norms-layers", type=layer_selection, default=DEFAULT_LAYERS,
                       help=f"Layers to log: {LAYER_FLAG_FORMS} (default: {DEFAULT_LAYERS}).")
    flags.add_argument("--layer-grad-norms-interval", type=positive_int, default=None,
                       help="Measure every N iterations (default: --tensorboard-log-interval).")
    flags.add_argument("--layer-grad-norms-trigger", type=_trigger_factor, default=None, metavar="FACTOR",
                       help="Capture every layer after a spike: the global gradient norm or the reported loss "
                       "above FACTOR x its running median, or an fp16 overflow (trigger.grad_norm_factor and "
                       "trigger.loss_factor).")
    flags.add_argument("--layer-grad-norms-history", type=_non_negative_int, default=None, metavar="K",
                       help="Record every layer's statistics of the last K steps, reduced when the trigger "
                       "fires (trigger.history; with the default trigger unless --layer-grad-norms-trigger).")
    flags.add_argument("--layer-grad-norms-optimizer-statistics", type=_optimizer_kinds, default=None, metavar="KINDS",
                       help=f"Also log what each measured optimizer step did to each layer: a comma-separated "
                       f"list of {','.join(OPTIMIZER_KINDS)} (the fp32 weights, the step's update, the Adam "
                       "moments; with param and update, their norms' ratio update-to-weight too); the ds_config's "
                       "optimizer_statistics.")
    flags.add_argument("--layer-grad-norms-adaptive-clipping", type=_remedy_type(AdaptiveClippingConfig), nargs="?",
                       const="", default=None, metavar="KEY=VALUE,...",
                       help="Clip each layer's gradient against the moving average of its own clipped norm (AdaGC) "
                       "after a warm-up of global clipping; optional settings such as beta=0.98,factor=1.05,"
                       "warmup_steps=100 (the ds_config's adaptive_clipping). Every step is then measured.")
    flags.add_argument("--layer-grad-norms-skip-step", type=_remedy_type(SkipStepConfig), nargs="?", const="",
                       default=None, metavar="KEY=VALUE,...",
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
    hook writes nothing without ``--log-layer-grad-norms``. The values are checked again here, by the parser's own
    checks, for a namespace no parser of these flags filled."""
    remedies = {key: _checked(args, flag, functools.partial(remedy_settings, model))
                for key, (flag, model) in REMEDY_FLAGS.items() if _flag_value(args, flag) is not None}
    if not getattr(args, "log_layer_grad_norms", False):
        return {"enabled": True, **remedies} if remedies else None
    _checked(args, "--layer-grad-norms-layers", layer_selection)
    _checked(args, "--layer-grad-norms-interval", positive_int)
    block = {"enabled": True, "layers": args.layer_grad_norms_layers, "interval": layer_grad_norms_interval(args)}
    trigger = _trigger_block(args)
    if trigger is not None:
        block["trigger"] = trigger
    kinds = _checked(args, "--layer-grad-norms-optimizer-statistics", _optimizer_kinds)
    if kinds is not None:
        block["optimizer_statistics"] = [kind.strip() for kind in kinds.split(",")]
    return {**block, **remedies}


REMEDY_FLAGS = {
    "adaptive_clipping": ("--layer-grad-norms-adaptive-clipping", AdaptiveClippingConfig),
    "skip_step": ("--layer-grad-norms-skip-step", SkipStepConfig),
}
"""Each remedy's ds_config key: its flag, and the model that checks the flag's settings."""


def _flag_value(args: argparse.Namespace, flag: str) -> Any:
    return getattr(args, flag.removeprefix("--").replace("-", "_"), None)


def _checked(args: argparse.Namespace, flag: str, check: Callable[[Any], Any]) -> Any:
    """``check`` of the flag's value (``None`` when unset), its refusal a ``ValueError`` naming the flag."""
    value = _flag_value(args, flag)
    if value is None:
        return None
    try:
        return check(value)
    except argparse.ArgumentTypeError as err:
        raise ValueError(f"{flag}: {err}") from None


def _number(text: str) -> Union[int, float, str]:
    """A flag setting's value as the JSON of a ds_config would have it: an int, a float, or (left to the check)
    the text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _trigger_block(args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """The ``trigger`` block of ``--layer-grad-norms-trigger`` and ``--layer-grad-norms-history``, or ``None``."""
    factor = _checked(args, "--layer-grad-norms-trigger", _trigger_factor)
    history = _checked(args, "--layer-grad-norms-history", _non_negative_int)
    if factor is None and history is None:
        return None
    trigger: Dict[str, Any] = {}
    if factor is not None:
        trigger.update(grad_norm_factor=factor, loss_factor=factor)
    if history is not None:
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
