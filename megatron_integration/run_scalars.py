"""The training loss and the global gradient norm a log holds beside the per-layer statistics, for ``plot``'s panel
under the norms: whether a layer's rise came with the loss's or the whole model's.

Each writer names them its own way, and a log holds them only where its writer logs them:

- Megatron's TensorBoard (and the demo's): ``lm loss`` and ``grad-norm`` (its `` vs samples`` copies left out);
- the Hugging Face Trainer: ``loss`` and ``grad_norm`` in ``trainer_state.json``'s ``log_history``,
  ``train/loss`` and ``train/grad_norm`` in its TensorBoard;
- DeepSpeed's monitor (TensorBoard or CSV): ``Train/Samples/train_loss``, written by its pipeline engine alone,
  against the sample count as its per-layer scalars; no global norm;
- the JSONL dump: neither (its lines are the per-layer results).

Where a log holds several names of one quantity (the Trainer's ``loss`` and its TensorBoard's ``train/loss``), the
first of ``LOSS_TAGS`` or ``GLOBAL_NORM_TAGS`` found is read.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from .log_sources import MONITOR_LOSS_TAG, is_dump, scalar_series
from .tensorboard_reader import latest_per_step

Points = List[Tuple[int, float]]

LOSS_TAGS = ("lm loss", "loss", "train/loss", MONITOR_LOSS_TAG)
"""The loss's tags (keys of the Trainer's ``log_history``), in the order preferred."""
GLOBAL_NORM_TAGS = ("grad-norm", "grad_norm", "train/grad_norm")
"""The global gradient norm's tags, in the order preferred."""


@dataclass
class RunScalars:
    """A log's loss and global gradient norm, one value per step (the last written); empty where it has none."""

    loss: Points = field(default_factory=list)
    global_norm: Points = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loss or self.global_norm)


def read_run_scalars(source: str) -> RunScalars:
    """The loss and the global gradient norm of ``source``, any log ``log_sources`` reads (the dump holds neither)."""
    if is_dump(source):
        return RunScalars()
    by_tag: Dict[str, Points] = {}
    for _, tag, points in scalar_series(source):
        if tag in LOSS_TAGS + GLOBAL_NORM_TAGS:  # runs resumed into folders of their own continue the series
            by_tag[tag] = latest_per_step(by_tag.get(tag, []) + points)
    return RunScalars(_first_found(by_tag, LOSS_TAGS), _first_found(by_tag, GLOBAL_NORM_TAGS))


def _first_found(by_tag: Dict[str, Points], tags: Sequence[str]) -> Points:
    """The series of the first of ``tags`` the log holds; empty where it holds none."""
    return next((by_tag[tag] for tag in tags if by_tag.get(tag)), [])


LOSS_GID, GLOBAL_NORM_GID = "loss", "global-norm"
"""The matplotlib ``gid`` of the panel's two lines."""


def draw_run_scalars(axis, scalars: RunScalars) -> None:
    """The panel under the norms: the loss on ``axis`` (left), the global norm on a log scale (right, or on
    ``axis`` itself where the log has no loss), one legend for both."""
    lines = []
    if scalars.loss:
        lines += axis.plot(*zip(*scalars.loss), color="tab:blue", linewidth=1.2, label="loss", gid=LOSS_GID)
        axis.set_ylabel("loss")
    if scalars.global_norm:
        norm_axis = axis.twinx() if scalars.loss else axis
        lines += norm_axis.plot(*zip(*scalars.global_norm), color="tab:orange", linewidth=1.2,
                                label="global gradient norm", gid=GLOBAL_NORM_GID)
        norm_axis.set_yscale("log")
        norm_axis.set_ylabel("global gradient L2 norm")
    axis.set_xlabel("step")
    axis.set_title("loss and global gradient norm")
    axis.legend(lines, [line.get_label() for line in lines], loc="upper right", fontsize="small")
