# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""How per-layer gradient statistics are named in results and logs: one scheme for every writer and reader.

A model with one stack of transformer layers keys them by ``int`` (``3``); a model with several, an
encoder's and a decoder's, by ``LayerKey`` (``"encoder.3"``); other buckets by their name.

TensorBoard draws one card per tag and one coloured, named line per run. The layout that draws the
NormFormer figure is therefore one run per layer, ``layer-grad-norms/layer00`` (``encoder.layer00`` for a
layer of the encoder's stack), a subdirectory of the log directory, each run holding the same tags:

- ``layer-grad-norms/pre-clip``, ``layer-grad-norms/post-clip``: the gradient norm;
- ``layer-grad-norms/values/max/pre-clip``, ``.../values/min/post-clip``, ...: the other statistics.

The norms sort first among the tags, so they are the first cards TensorBoard shows. Buckets outside
the transformer layers (embeddings, final norm, head) have runs of their own but their tags under
``non-layer-grad-norms``, so that they do not share a chart, nor its colours, with the layers.

A writer that puts (tag, value, step) events into one run, as DeepSpeed's monitors do, uses the flat
form: the bucket appended to the tag, ``layer-grad-norms/pre-clip/layer00``.

The flight recorder's steps (``trigger.history``) go to runs of their own, one directory per fire:
``layer-grad-norms-history/fire-000123/layer00`` holding ``layer-grad-norms-history/pre-clip`` and the
like. Those steps were logged already; written again into the runs above, the steps would go backwards
and TensorBoard would purge every later point of those runs (``purge_orphaned_data``). A run per fire is
written once, its steps in order, and its cards are apart from the live ones.
"""

import math
import re
from typing import Dict, Hashable, Iterable, Optional, Tuple, Union

__all__ = [
    "TAG_ROOT", "OUTSIDE_LAYERS_ROOT", "VALUES", "LOGGED_PHASES", "LOGGED_STATISTICS", "OPTIMIZER_KINDS",
    "UPDATE_TO_WEIGHT", "ALL_PHASES", "update_to_weight", "norm_ratio", "logged_result", "LayerKey", "LayerId",
    "is_layer", "layer_position", "bucket_label", "layer_of_label", "phase_label", "phase_statistics", "scalar_tag",
    "run_name", "flat_scalars", "HISTORY_ROOT", "HISTORY_RUN", "history_root", "history_run_name", "ADAPTIVE_CLIP",
    "SKIPPED", "SKIPPED_TAG", "step_scalars", "WRITTEN_PHASES"
]

TAG_ROOT = "layer-grad-norms"
"""The tags of buckets in the transformer layers, and the directory holding the runs of all buckets."""
OUTSIDE_LAYERS_ROOT = "non-layer-grad-norms"
"""The tags of buckets outside the transformer layers, under the one-run-per-bucket layout."""
HISTORY_ROOT = f"{TAG_ROOT}-history"
"""The runs and tags of the flight recorder's steps, one directory of runs per fire."""
VALUES = "values"
"""The statistics other than the norm (min, max, ...): of the gradient's values."""
LOGGED_PHASES = ("pre_clip", "post_clip")
LOGGED_STATISTICS = ("norm", "min", "max")
"""What goes to logs, of every selected bucket; the rest of the result stays in the result."""
OPTIMIZER_KINDS = ("param", "update", "exp_avg", "exp_avg_sq")
"""What an optimizer step did (``optimizer_statistics``): a result's keys beside the gradient's phases, logged
as phases of their own (``layer-grad-norms/update``, ``layer-grad-norms/values/max/exp-avg-sq``)."""
UPDATE_TO_WEIGHT = "update_to_weight"
"""The phase derived for logs where a result holds both ``update`` and ``param``: per bucket, the norm of the
update over the norm of the weights (``update_to_weight``)."""
ADAPTIVE_CLIP = "adaptive_clip"
"""The result's key of adaptive clipping's factors (``adaptive_clipping``): ``{bucket: factor}``, 1.0 where a bucket
was not clipped; logged as a phase of its own (``layer-grad-norms/adaptive-clip``, each bucket's factor as its
"norm"), so that which layers were clipped, and by how much, is one chart."""
SKIPPED = "skipped"
"""The result's key saying that ``skip_step`` skipped the step (with ``skip_reason``), present while it is on."""
SKIPPED_TAG = f"{TAG_ROOT}/skipped-step"
"""The scalar of a step ``skip_step`` judged: 1 skipped, 0 applied; one per step, in the writer's own run."""
ALL_PHASES = LOGGED_PHASES + OPTIMIZER_KINDS + (UPDATE_TO_WEIGHT, )
"""Every signal a log may hold, in the order the logs list them (what a fire's judgement reads)."""
WRITTEN_PHASES = ALL_PHASES + (ADAPTIVE_CLIP, )
"""Every phase the writers write: the signals, and adaptive clipping's factors (a remedy's action, not a signal)."""

_LAYER_LABEL = re.compile(r"^(?:(.+)\.)?layer(\d+)$")
HISTORY_RUN = re.compile(rf"(?:^|/){HISTORY_ROOT}/fire-(\d+)/([^/]+)$")
"""A run ``history_run_name`` named: its groups are the fire's step and the bucket's label."""


class LayerKey(str):
    """The key of a transformer layer in a model of several layer stacks: ``"encoder.3"`` is layer 3 of
    the stack labelled ``encoder``.

    A ``str``, equal to and hashing as ``"encoder.3"``, so that results are indexed with plain strings and
    dumped to JSON as they are; its ``stack`` and ``index`` tell writers it is a layer, not a bucket
    named after a module.
    """

    stack: str
    index: int

    def __new__(cls, stack: str, index: int) -> "LayerKey":
        key = super().__new__(cls, f"{stack}.{index}")
        key.stack, key.index = stack, index
        return key

    def __getnewargs__(self) -> Tuple[str, int]:
        return self.stack, self.index


LayerId = Union[int, LayerKey]
"""A transformer layer: its index in a model of one stack, its ``LayerKey`` in a model of several."""


def is_layer(key: Hashable) -> bool:
    """Whether a bucket key is a whole transformer layer (``3`` or ``"encoder.3"``)."""
    return isinstance(key, (int, LayerKey))


def layer_position(layer: LayerId) -> Tuple[Optional[str], int]:
    """A layer's stack (``None`` in a model of one stack) and its index in that stack."""
    return (layer.stack, layer.index) if isinstance(layer, LayerKey) else (None, layer)


def bucket_label(key: Hashable) -> str:
    """How a bucket is named in logs: ``layer03`` for transformer layer 3, ``encoder.layer03`` for layer 3
    of the encoder's stack, the bucket name otherwise."""
    if not is_layer(key):
        return str(key)
    stack, index = layer_position(key)
    return f"layer{index:02d}" if stack is None else f"{stack}.layer{index:02d}"


def layer_of_label(label: str) -> Optional[LayerId]:
    """The layer ``bucket_label`` named ``label``; ``None`` for a bucket that is not a layer."""
    match = _LAYER_LABEL.match(label)
    if match is None:
        return None
    stack, index = match.groups()
    return int(index) if stack is None else LayerKey(stack, int(index))


def phase_label(phase: str) -> str:
    """``pre-clip`` for the result's ``pre_clip`` key."""
    return phase.replace("_", "-")


def phase_statistics(phase: str) -> Tuple[str, ...]:
    """The statistics logged of a phase: ``LOGGED_STATISTICS``, the "norm" alone of the ``update_to_weight`` ratio
    and of the ``adaptive_clip`` factors."""
    return ("norm", ) if phase in (UPDATE_TO_WEIGHT, ADAPTIVE_CLIP) else LOGGED_STATISTICS


def scalar_tag(phase: str, statistic: str, bucket: Optional[Hashable] = None, root: str = TAG_ROOT) -> str:
    """The tag of one statistic: ``layer-grad-norms/pre-clip`` for the norm,
    ``layer-grad-norms/values/max/pre-clip`` for another, with ``/{bucket_label(bucket)}`` appended
    when a bucket is given (the flat form, every bucket in one run)."""
    path = phase_label(phase) if statistic == "norm" else f"{VALUES}/{statistic}/{phase_label(phase)}"
    tag = f"{root}/{path}"
    return tag if bucket is None else f"{tag}/{bucket_label(bucket)}"


def update_to_weight(result: dict) -> Optional[dict]:
    """Per bucket, ``{"norm": |update| / |param|}`` of a result holding both kinds, else ``None``. Over weights
    of norm zero the ratio is infinite where the update is not zero, zero where it is."""
    update, param = result.get("update"), result.get("param")
    if not update or not param:
        return None
    return {bucket: {"norm": norm_ratio(update[bucket]["norm"], param[bucket]["norm"])} for bucket in update}


def norm_ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator`` of two norms: infinite over a zero denominator, zero where both are zero."""
    if denominator:
        return numerator / denominator
    return math.inf if numerator else 0.0


def logged_result(result: dict) -> dict:
    """A result as logs see it: ``result`` with the ``update_to_weight`` phase added where it can be derived, and
    the ``adaptive_clip`` factors shaped as a phase (``{bucket: {"norm": factor}}``)."""
    derived = {}
    ratio = update_to_weight(result)
    if ratio is not None:
        derived[UPDATE_TO_WEIGHT] = ratio
    factors = result.get(ADAPTIVE_CLIP)
    if factors:
        derived[ADAPTIVE_CLIP] = {bucket: {"norm": factor} for bucket, factor in factors.items()}
    return {**result, **derived} if derived else result


def step_scalars(result: dict) -> Dict[str, float]:
    """The scalars of a result that belong to the step, not to a bucket: ``SKIPPED_TAG`` while ``skip_step`` is on."""
    return {SKIPPED_TAG: float(result[SKIPPED])} if SKIPPED in result else {}


def run_name(bucket: Hashable) -> str:
    """The run of a bucket, a subdirectory of the log directory: ``layer-grad-norms/layer00``."""
    return f"{TAG_ROOT}/{bucket_label(bucket)}"


def flat_scalars(result: dict,
                 phases: Iterable[str] = WRITTEN_PHASES,
                 statistics: Iterable[str] = LOGGED_STATISTICS) -> Dict[str, float]:
    """Every selected bucket's ``statistics`` of a ``get_layer_grad_norms()`` result as logs see it
    (``logged_result``), by flat tag (``layer-grad-norms/pre-clip/layer00``, ``layer-grad-norms/update/layer00``);
    a phase the result lacks (post-clip on an overflow step, a kind not requested) is left out, and so is a
    statistic a phase lacks (the ``update_to_weight`` ratio has only its norm)."""
    logged = logged_result(result)
    return {
        **{
            scalar_tag(phase, name, key): values[name]
            for phase in phases
            for key, values in (logged.get(phase) or {}).items()
            for name in statistics if name in values
        },
        **step_scalars(result)
    }


def history_run_name(fired_at: int, bucket: Hashable) -> str:
    """The run of a bucket's recorded steps at the fire of step ``fired_at``:
    ``layer-grad-norms-history/fire-000123/layer00``."""
    return f"{HISTORY_ROOT}/fire-{fired_at:06d}/{bucket_label(bucket)}"


def history_root(root: str) -> str:
    """The tag root of the recorded steps of buckets whose live tags are under ``root``:
    ``layer-grad-norms-history``, ``non-layer-grad-norms-history``."""
    return f"{root}-history"
