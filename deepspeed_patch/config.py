# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The ``layer_grad_norms`` block of a ds_config, and its validation.

Every key is validated when ``deepspeed.initialize`` reads the block, so that a typo fails the
launch with an error naming the key and the value instead of silently measuring nothing.
"""

import difflib
import logging
import re
from typing import Any, List, Optional, Tuple, Union

from pydantic import ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

from .capabilities import DeepSpeedConfigModel
from .outputs.process_rank import rank_of_process
from .outputs.tags import OPTIMIZER_KINDS

logger = logging.getLogger(__name__)

CONFIG_KEY = "layer_grad_norms"
REMEDIES = ("adaptive_clipping", "skip_step")
"""The sub-blocks that change the optimizer step; ``enabled: false`` switches them off too (``master_switch``)."""

# One layer of a selection: an index (negative counts from the last layer) or "mid" (L // 2).
LayerToken = Union[int, str]

LAYER_SPEC_FORMS = '"all", a list such as [0, 1, "mid", -2, -1], or the string "0,1,mid,-2,-1"'

GRANULARITIES = ("layer", "param", "group_by")
# Statistics beyond norm, min, max, abs_min, abs_max and nonfinite, which are always reported.
EXTRA_STATISTICS = ("l1", "mean", "zeros", "numel")
# What an optimizer step did, per bucket (``optimizer_stats``): fp32 master weights, update and Adam moments.
OPTIMIZER_STATISTICS = OPTIMIZER_KINDS


class LayerGradNormsConfigError(ValueError):
    """A bad value in the ``layer_grad_norms`` block; the message names the key and the value."""


class UnsupportedSetupError(RuntimeError):
    """``layer_grad_norms`` is enabled on a set-up it cannot measure correctly (yet)."""


def parse_layer_spec(spec: Any) -> Optional[Tuple[LayerToken, ...]]:
    """Normalise a layer selection to a tuple of tokens, or ``None`` for all layers.

    Accepts ``"all"`` (or ``None``), a list of ints and ``"mid"``, or the same list as a
    comma-separated string.
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec.strip().lower() == "all":
            return None
        items: List[Any] = [item.strip() for item in spec.split(",")]
    elif isinstance(spec, (list, tuple)):
        items = list(spec)
    else:
        raise ValueError(f"expected {LAYER_SPEC_FORMS}")
    if not items:
        raise ValueError(f"empty layer selection; expected {LAYER_SPEC_FORMS}")
    return tuple(_parse_layer_token(item) for item in items)


def _parse_layer_token(item: Any) -> LayerToken:
    if isinstance(item, bool):
        raise ValueError(f"{item!r} is not a layer; expected {LAYER_SPEC_FORMS}")
    if isinstance(item, int):
        return item
    if isinstance(item, str):
        if item.lower() == "mid":
            return "mid"
        if re.fullmatch(r"-?\d+", item):
            return int(item)
    raise ValueError(f"{item!r} is not a layer index or 'mid'; expected {LAYER_SPEC_FORMS}")


def _compile(pattern: str) -> "re.Pattern[str]":
    try:
        return re.compile(pattern)
    except re.error as err:
        raise ValueError(f"not a valid regular expression: {err}") from err


class StrictConfigModel(DeepSpeedConfigModel):
    """A block whose values must have their key's type as written: ``"interval": "10"`` or ``"enabled": 1`` is
    an error naming the key (``_describe``), not a value converted silently; an integer is still a number."""

    model_config = ConfigDict(strict=True)


class TriggerConfig(StrictConfigModel):
    """Capture every step, all layers, for ``capture_steps`` steps after a gradient-norm spike."""

    grad_norm_factor: Optional[float] = Field(3.0, gt=1.0)
    """Fire when the global gradient norm exceeds this many times its running median; ``None``: the norm is not
    watched, nor read (a trigger on a host loss alone then costs no host synchronisation)."""
    window: int = Field(50, ge=1)
    """Steps in the running median."""
    capture_steps: int = Field(20, ge=1)
    on_overflow: StrictBool = True
    """Fire also when the fp16 loss scaler skips ``overflow_steps`` steps in a row."""
    overflow_steps: int = Field(3, ge=1)
    """Skipped steps in a row that fire (with ``on_overflow``): routine dynamic loss scaling skips one or two
    in a row (a grown scale that overflows, with DeepSpeed's default ``hysteresis`` of 2); keep it above the
    fp16 block's ``hysteresis``. Skipped steps from step 1 on (the scaler's search for a scale) never fire."""
    cooldown: Optional[int] = Field(None, ge=1)
    """Steps from a fire to the next at the least; ``None``: ``capture_steps + 1`` or ``history``, whichever
    is longer, so that no fire comes while capturing and no two fires' recorded steps overlap."""
    history: int = Field(0, ge=0)
    """Record every step's local statistics in a ring of this many steps, reduced when the trigger fires
    (``engine.get_layer_grad_norms_history()``); 0: no recorder."""
    loss_factor: Optional[float] = Field(None, gt=1.0)
    """Fire also when the loss the training loop reports (``report_loss``; the largest any rank reported, all-reduced
    on every step: ``reduction.agreed_losses``) exceeds this many times its running median; ``None``: not watched."""

    def refractory_steps(self) -> int:
        """``cooldown``, or its default."""
        return self.cooldown if self.cooldown is not None else max(self.capture_steps + 1, self.history)


class DumpConfig(StrictConfigModel):
    """A JSONL file with the full result of every measured step, written by rank 0."""

    path: str
    max_bytes: int = Field(100 * 2**20, ge=1024)
    backups: int = Field(3, ge=0)


class AdaptiveClippingConfig(StrictConfigModel):
    """Per-bucket adaptive gradient clipping (AdaGC, arXiv 2502.11034): after ``warmup_steps`` applied steps of
    DeepSpeed's global clipping, each bucket's gradient is scaled by ``min(1, factor * ema / norm)``, ``ema``
    the bucket's exponential moving average (``beta``) of its own clipped norms (``adaptive_clipping.py``)."""

    enabled: StrictBool = False
    beta: float = Field(0.98, gt=0.0, lt=1.0)
    """The EMA's weight of its previous value (AdaGC's beta)."""
    factor: float = Field(1.05, gt=0.0)
    """How far above its EMA a bucket's norm may go before it is clipped (AdaGC's lambda_rel)."""
    warmup_steps: int = Field(100, ge=1)
    """Applied optimizer steps under global clipping before the per-bucket rule takes over (AdaGC's T_start);
    meanwhile each bucket's EMA holds the smallest clipped norm seen."""


class SkipStepConfig(StrictConfigModel):
    """Skip the optimizer step whose loss or global gradient norm lies more than ``sigma`` standard deviations
    above the mean of its last ``window`` values (OLMo-core's ``SkipStepOptimizer``; ``skip_step.py``)."""

    enabled: StrictBool = False
    sigma: float = Field(6.0, gt=0.0)
    window: int = Field(128, ge=2)


class LayerGradNormsConfig(StrictConfigModel):
    """Per-layer gradient statistics inside the ZeRO-1/2 optimizer."""

    enabled: StrictBool = False
    """Measure per-layer statistics. Without the block, or with ``false``, nothing changes: the remedies are off
    whatever their sub-blocks say (``master_switch``)."""

    layers: Optional[Tuple[LayerToken, ...]] = None
    """Layers to report: ``"all"`` (stored as ``None``) or a selection, see ``parse_layer_spec``."""

    interval: int = Field(1, ge=1)
    """Measure every N-th optimizer step; the steps in between do no extra work."""

    layer_pattern: Optional[str] = None
    """Regex with one capture group, the layer index; ``None`` recognises the common layouts."""

    granularity: str = "layer"
    """One bucket per transformer layer (``layer``), per parameter (``param``, keyed by its name), or
    per match of ``group_by`` (``group_by``)."""

    group_by: Optional[str] = None
    """With ``granularity: group_by``: a regex whose capture groups, joined by ``.``, form the bucket
    key; parameters it does not match are not measured."""

    statistics: Tuple[str, ...] = ()
    """Extra statistics, computed in the same pass: ``l1`` (sum of absolute values), ``mean``,
    ``zeros`` (count of exact zeros), ``numel``."""

    optimizer_statistics: Tuple[str, ...] = ()
    """What the optimizer step did, per bucket, on measured steps: ``param`` (fp32 master weights after the
    step), ``update`` (after minus before), ``exp_avg``, ``exp_avg_sq`` (Adam's moments after the step);
    each a result key of its own. Empty: off."""

    trigger: Optional[TriggerConfig] = None
    """Switch full capture on after a spike, with ``enabled`` false too; see ``TriggerConfig``."""

    control_file: Optional[str] = None
    """A JSON file (``enabled``, ``interval``, ``layers``) that rank 0 reads every ``control_interval``
    steps and broadcasts: switch the statistics on or off from outside a running job, one started with ``enabled``
    false too."""

    control_interval: int = Field(10, ge=1)

    dump: Optional[DumpConfig] = None

    monitor: StrictBool = True
    """Also write the selected buckets' statistics to DeepSpeed's monitors (TensorBoard, W&B, CSV),
    when the ds_config enables any."""

    adaptive_clipping: AdaptiveClippingConfig = Field(default_factory=AdaptiveClippingConfig)
    """Per-bucket adaptive clipping from the measured norms (off by default); see ``AdaptiveClippingConfig``."""

    skip_step: SkipStepConfig = Field(default_factory=SkipStepConfig)
    """Skipping a spiking step (off by default); see ``SkipStepConfig``."""

    def acts(self) -> bool:
        """Whether a remedy (``adaptive_clipping``, ``skip_step``) changes the optimizer step: then every step is
        measured, and its reduction comes before the optimizer step."""
        return self.adaptive_clipping.enabled or self.skip_step.enabled

    @field_validator("layers", mode="before")
    @classmethod
    def _validate_layers(cls, value: Any) -> Optional[Tuple[LayerToken, ...]]:
        return parse_layer_spec(value)

    @field_validator("layer_pattern")
    @classmethod
    def _validate_layer_pattern(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and _compile(value).groups != 1:
            raise ValueError(f"needs exactly one capture group (the layer index), found {_compile(value).groups}")
        return value

    @field_validator("granularity")
    @classmethod
    def _validate_granularity(cls, value: str) -> str:
        if value not in GRANULARITIES:
            raise ValueError(f"expected one of {list(GRANULARITIES)}")
        return value

    @field_validator("group_by")
    @classmethod
    def _validate_group_by(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and _compile(value).groups == 0:
            raise ValueError("needs at least one capture group (the groups form the bucket key)")
        return value

    @field_validator("statistics", mode="before")
    @classmethod
    def _validate_statistics(cls, value: Any) -> Tuple[str, ...]:
        return tuple(_names_from(value, EXTRA_STATISTICS, "statistic"))

    @field_validator("optimizer_statistics", mode="before")
    @classmethod
    def _validate_optimizer_statistics(cls, value: Any) -> Tuple[str, ...]:
        names = _names_from(value, OPTIMIZER_STATISTICS, "optimizer statistic")
        return tuple(name for name in OPTIMIZER_STATISTICS if name in names)

    @model_validator(mode="after")
    def _group_by_goes_with_its_granularity(self) -> "LayerGradNormsConfig":
        if (self.granularity == "group_by") != (self.group_by is not None):
            raise ValueError(f"granularity={self.granularity!r} with group_by={self.group_by!r}: "
                             "'group_by' is needed with, and only with, granularity 'group_by'")
        return self


def _names_from(value: Any, known: Tuple[str, ...], what: str) -> List[str]:
    """``value`` checked to be a list of names from ``known`` (each a ``what``)."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"expected a list of {what}s from {list(known)}")
    unknown = [name for name in value if name not in known]
    if unknown:
        raise ValueError(f"unknown {what} {unknown[0]!r}; known: {list(known)}")
    return list(value)


def load_config(param_dict: dict) -> LayerGradNormsConfig:
    """Read the ``layer_grad_norms`` block of a ds_config dict; absent means disabled.

    A top-level key that looks like a misspelling of the block's name is an error: DeepSpeed ignores
    keys it does not know, so the block would be dropped and nothing measured, without a word.
    """
    misspelled = [key for key in param_dict if _looks_like_config_key(key)]
    if misspelled:
        raise LayerGradNormsConfigError(f"ds_config key {misspelled[0]!r}: unknown; did you mean {CONFIG_KEY!r}? "
                                        "(as written, the block would be ignored and nothing measured)")
    block = param_dict.get(CONFIG_KEY, {})
    if not isinstance(block, dict):
        raise LayerGradNormsConfigError(f"{CONFIG_KEY}={block!r}: expected a JSON object")
    try:
        config = LayerGradNormsConfig(strict=True, **block)
    except ValidationError as err:
        raise LayerGradNormsConfigError(_describe(err, block)) from None
    return master_switch(config)


def master_switch(config: LayerGradNormsConfig) -> LayerGradNormsConfig:
    """``config`` with its remedies off where ``enabled`` is false: a switched-off block changes nothing, and a
    remedy changes the optimizer step. The remedies it turns off are named in one warning (rank 0)."""
    ignored = [name for name in REMEDIES if getattr(config, name).enabled]
    if config.enabled or not ignored:
        return config
    if rank_of_process() == 0:
        logger.warning("%s.enabled=false: %s ignored (enabled is the master switch; set it to true to act)",
                       CONFIG_KEY, ", ".join(f"{name}.enabled=true" for name in ignored))
    return config.model_copy(update={name: type(getattr(config, name))() for name in ignored})


# How close (difflib ratio, on the key lower-cased without "_" and "-") a top-level ds_config key must be
# to CONFIG_KEY to be taken for a misspelling of it; DeepSpeed's own keys all score below 0.6.
MISSPELLING_CUTOFF = 0.85


def _looks_like_config_key(key: Any) -> bool:
    """``key`` is not ``CONFIG_KEY`` but a variant of it: other case, ``-`` or no separator, a typo."""
    if not isinstance(key, str) or key == CONFIG_KEY:
        return False
    squeezed = re.sub(r"[-_]", "", key.lower())
    return difflib.SequenceMatcher(None, squeezed, CONFIG_KEY.replace("_", "")).ratio() >= MISSPELLING_CUTOFF


EXPECTED_TYPES = {
    "bool_type": "true or false",
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "dict_type": "a JSON object",
    "model_type": "a JSON object",
}
"""What a value of the wrong type should have been, by pydantic's error type (strict: no conversion)."""


def _describe(err: ValidationError, block: dict) -> str:
    lines = []
    for problem in err.errors():
        if not problem["loc"]:  # a check across keys: its message names them
            lines.append(f"{CONFIG_KEY}: {problem['msg'].removeprefix('Value error, ')}")
            continue
        key = ".".join(str(part) for part in problem["loc"])
        value = _lookup(block, problem["loc"], problem.get("input"))
        reason = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden":
            reason = f"unknown key; known keys are {sorted(_model_at(problem['loc'][:-1]).model_fields)}"
        elif problem["type"] in EXPECTED_TYPES:
            reason = f"expected {EXPECTED_TYPES[problem['type']]}"
        elif problem["type"] == "missing":
            reason, value = "required", "missing"
        lines.append(f"{CONFIG_KEY}.{key}={value!r}: {reason}" if value !=
                     "missing" else f"{CONFIG_KEY}.{key}: {reason}")
    return "invalid ds_config block: " + "; ".join(lines)


def _model_at(location: tuple) -> type:
    """The model of the nested block at ``location``, its keys from the top block down."""
    model = LayerGradNormsConfig
    for part in location:
        annotation = model.model_fields[part].annotation
        model = next(arg for arg in getattr(annotation, "__args__", (annotation, )) if isinstance(arg, type))
    return model


def _lookup(block: dict, location: tuple, default: Any) -> Any:
    """The user's value at a nested ``location`` of the block, as they wrote it."""
    value: Any = block
    for part in location:
        if not isinstance(value, dict) or part not in value:
            return default
        value = value[part]
    return value
