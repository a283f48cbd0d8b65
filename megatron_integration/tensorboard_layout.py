"""Where each bucket's statistics go in TensorBoard: its run and its tags, and the Custom Scalars layout.

One run per layer (``layer-grad-norms/layer00``, ``layer-grad-norms/encoder.layer00`` in a model of several
layer stacks), each holding one tag per phase and statistic (``layer-grad-norms/pre-clip``,
``layer-grad-norms/update``), so that TensorBoard draws one card per statistic with one coloured, named line
per layer. The names themselves are in ``deepspeed_patch.outputs.tags``.
"""

import re
from collections import Counter
from dataclasses import dataclass
from typing import Dict, Hashable, Iterable, List, Optional, Tuple

from deepspeed_patch.outputs.tags import (
    LOGGED_PHASES,
    OUTSIDE_LAYERS_ROOT,
    TAG_ROOT,
    LayerId,
    is_layer,
    phase_label,
    phase_statistics,
    run_name,
    scalar_tag,
)

_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_and_family(key: Hashable) -> Tuple[Optional[int], Optional[str]]:
    """Where a finer bucket (``granularity: param`` or ``group_by``) lies: ``(3, "mlp.fc2.weight")`` for
    ``layers.3.mlp.fc2.weight``, ``(3, "dense_4h_to_h")`` for ``3.dense_4h_to_h``, ``(None, None)``
    for a bucket with no layer index in its name."""
    match = _LAYER_INDEX.search(key) if isinstance(key, str) else None
    if match is None:
        return None, None
    return int(match.group(1)), key[match.end():] or None


@dataclass(frozen=True)
class Placement:
    """Where one bucket's statistics go: the run, the root of its tags, and the name the tags end with
    (a finer bucket's part of its layer; ``None`` for a whole bucket)."""

    run: str
    root: str
    name: Optional[str]
    layer: Optional[LayerId]

    def tag(self, phase: str, statistic: str) -> str:
        return scalar_tag(phase, statistic, self.name, root=self.root)


def placements(keys: Iterable[Hashable]) -> Dict[Hashable, Placement]:
    """Each bucket's place: a layer in its layer's run under ``layer-grad-norms``, finer buckets in the
    run of the layer their name carries (when no bucket is a whole layer), named by their part of the
    layer (by their whole name where two of the same part share a layer index, as an encoder's and a
    decoder's would), any other bucket in a run of its own under ``non-layer-grad-norms``, so that it
    shares no chart with the layers."""
    keys = list(keys)
    finer = not any(is_layer(key) for key in keys)
    split = {key: (key, None) if is_layer(key) else layer_and_family(key) if finer else (None, None) for key in keys}
    shared = Counter(where for where in split.values() if where[0] is not None)
    ambiguous = {family for (_, family), count in shared.items() if count > 1}
    placed = {}
    for key, (layer, family) in split.items():
        if layer is None:
            placed[key] = Placement(run_name(key), OUTSIDE_LAYERS_ROOT, None, None)
        else:
            placed[key] = Placement(run_name(layer), TAG_ROOT, key if family in ambiguous else family, layer)
    return placed


def custom_scalars_layout(keys: Iterable[Hashable] = (),
                          phases: Iterable[str] = LOGGED_PHASES) -> Dict[str, Dict[str, List]]:
    """For the Custom Scalars tab: a category per phase (the gradient's, and any optimizer kind and the
    update-to-weight ratio in ``phases``) of one multi-line chart per statistic, the selected layers together
    (NormFormer's figure); one more per part of a layer with finer buckets, and per phase for the buckets
    outside the layers."""
    placed = placements(keys).values()
    names = sorted({place.name for place in placed if place.name is not None})
    layout = {}
    for phase in phases:
        title = f"{TAG_ROOT} {phase_label(phase)}"
        layout[title] = _charts(phase, None, TAG_ROOT)
        for name in names:
            layout[f"{title}: {name}"] = _charts(phase, name, TAG_ROOT)
        if any(place.root == OUTSIDE_LAYERS_ROOT for place in placed):
            layout[f"{OUTSIDE_LAYERS_ROOT} {phase_label(phase)}"] = _charts(phase, None, OUTSIDE_LAYERS_ROOT)
    return layout


def _charts(phase: str, name: Optional[str], root: str) -> Dict[str, List]:
    return {
        statistic: ["Multiline", [f"^{re.escape(scalar_tag(phase, statistic, name, root=root))}$"]]
        for statistic in phase_statistics(phase)
    }
