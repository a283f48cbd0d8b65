"""Which log a path is, and its scalar series: ``plot`` and ``report`` read every log a run may leave.

- a TensorBoard directory (searched recursively), or one events file (``events.out.tfevents.*``): the
  Megatron hook's runs, DeepSpeed's own monitor (``Train/Samples/layer-grad-norms/...``), the Hugging Face
  Trainer's integration (``train/layer-grad-norms/...``, under ``OUTPUT_DIR/runs/...``); a tag is read
  whatever prefix a writer puts before ``layer-grad-norms/``;
- DeepSpeed's CSV monitor: files ``Train_Samples_layer-grad-norms_pre-clip_layer00.csv`` (the tag with
  ``/`` made ``_``; ``..._update_layer00.csv`` for an optimizer kind), one, or a directory holding them (and
  the pipeline engine's loss, ``Train_Samples_train_loss.csv``);
- the Hugging Face Trainer's ``trainer_state.json`` (its ``log_history``), given as the file, or found in
  the output directory or its newest ``checkpoint-N/`` when the directory holds no per-layer scalars;
- the JSONL dump (``layer_grad_norms.dump``), with its rotated files (``dump.jsonl.1``, ...: read oldest
  first), read as records rather than scalars (``dump_records``).

A path that does not exist, or a file none of these, is a ``LogSourceError`` with a one-line message; so is a
directory holding several training runs (``training_runs``: a Megatron TensorBoard root, a ``runs/`` folder of
demos), which is never merged: the message names them, and ``--run NAME`` (the run's folder) picks one. Runs that
each begin at a later step than the one written before them are one training resumed into a folder of its own (the
Hugging Face Trainer's ``runs/<date>``), read as one.
"""

import csv
import glob
import json
import math
import os
import re
from typing import Dict, Iterator, List, Optional, Tuple

from deepspeed_patch.outputs.tags import ALL_PHASES, SKIPPED_TAG, TAG_ROOT, WRITTEN_PHASES, phase_label, scalar_tag

Points = List[Tuple[int, float]]
Series = Tuple[str, str, Points]
"""``(run, tag, points)``: the points in the order they were written."""

TRAINER_STATE = "trainer_state.json"
PHASE_PATTERN = "(" + "|".join(re.escape(phase_label(phase)) for phase in ALL_PHASES) + ")"
"""A phase as tags name it (``pre-clip``, ``exp-avg-sq``, ``update-to-weight``), one regex group."""
_BUCKET_RUNS = re.compile(rf"(?:^|/)(?:non-)?{TAG_ROOT}(?:-history)?(?:/.*)?$")
"""The writers' runs of one training run, under its folder: per bucket, per fire (``layer-grad-norms/layer00``,
``non-layer-grad-norms/embed``, ``layer-grad-norms-history/fire-000150/layer03``)."""
_OUR_TAG = re.compile(rf"^(.*?)(?:non-)?{TAG_ROOT}(?:-history)?/")
"""A tag of ours, its writer's prefix (``Train/Samples/``, ``train/``, none) its group."""
_WRITTEN_PATTERN = "(" + "|".join(re.escape(phase_label(phase)) for phase in WRITTEN_PHASES) + ")"
"""Every phase a writer writes: the signals, and adaptive clipping's factors (``adaptive-clip``)."""
_CSV_NAME = re.compile(rf"(?:^|_){TAG_ROOT}_(?:{_WRITTEN_PATTERN}|values_([a-z0-9]+)_{PHASE_PATTERN})_(.+)$")
_CSV_SKIPPED = re.compile(rf"(?:^|_){re.escape(SKIPPED_TAG.replace('/', '_'))}$")
"""The file of ``skip_step``'s scalar, a step's rather than a bucket's."""
MONITOR_LOSS_TAG = "Train/Samples/train_loss"
"""DeepSpeed's monitor's tag of the pipeline engine's loss, for ``plot``'s panel of it (``run_scalars``)."""
_CSV_LOSS = MONITOR_LOSS_TAG.replace("/", "_")
"""The CSV monitor's file of it (the tag with ``/`` made ``_``, as every file of that monitor)."""
_EVENTS_FILE = "tfevents"
_SNIFF_BYTES = 4096
_MAX_LINE = 1 << 24
READABLE = ("a TensorBoard directory or events file, a JSONL dump (layer_grad_norms.dump), a trainer_state.json, "
            "or DeepSpeed's CSV monitor output")


class LogSourceError(ValueError):
    """A path ``plot`` or ``report`` cannot read; the message is one line naming the path."""


def dump_files(path: str) -> List[str]:
    """The dump ``path`` and its rotated files, oldest first: ``dump.jsonl.3``, ..., ``dump.jsonl.1``,
    ``dump.jsonl`` (``JsonlDump`` renames ``.1`` to ``.2`` and the live file to ``.1`` when it rotates)."""
    rotated = []
    while os.path.isfile(f"{path}.{len(rotated) + 1}"):
        rotated.append(f"{path}.{len(rotated) + 1}")
    return rotated[::-1] + [path]


def dump_records(path: str) -> Iterator[dict]:
    """Every result of the dump ``path`` and its rotated files, in the order written; a line cut short by a
    killed job (or a rotation) is skipped."""
    for name in dump_files(path):
        with open(name, encoding="utf-8") as dump:
            for line in dump:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and "step" in record:
                    yield record


def is_dump(path: str) -> bool:
    """Whether ``path`` is a JSONL dump; raises ``LogSourceError`` for a path that is no log read here."""
    return _kind(path) == "dump"


def _kind(path: str) -> str:
    if os.path.isdir(path):
        return "directory"
    if not os.path.exists(path):
        raise LogSourceError(f"{path}: no such file or directory")
    if _EVENTS_FILE in os.path.basename(path):
        return "events"
    _refuse_binary(path)
    if path.endswith(".csv"):
        return "csv"
    first = _first_line(path)
    try:
        record = json.loads(first)
    except ValueError:
        record = None
    if isinstance(record, dict) and "step" in record:
        return "dump"
    if _trainer_state(path) is not None:
        return "trainer_state"
    raise LogSourceError(f"{path}: not a log read here (expected {READABLE})")


def _refuse_binary(path: str) -> None:
    """A ``LogSourceError`` for a binary file, judged by its first bytes."""
    with open(path, "rb") as log:
        head = log.read(_SNIFF_BYTES)
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as err:
        cut_short = len(head) == _SNIFF_BYTES and err.start >= len(head) - 3  # a character cut by the read
        text = head[:err.start].decode("utf-8") if cut_short else "\0"
    if "\0" in text:
        raise LogSourceError(f"{path}: a binary file, not a log read here (expected {READABLE})")


def _first_line(path: str) -> str:
    """The first line of a text file that is not blank, read whole (up to ``_MAX_LINE``): a dump's line outgrows
    any sniffed head (every layer's statistics, the optimizer kinds)."""
    with open(path, encoding="utf-8", errors="replace") as log:
        for line in iter(lambda: log.readline(_MAX_LINE), ""):
            if line.strip():
                return line
    return ""


def _trainer_state(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as state:
            loaded = json.load(state)
    except (ValueError, UnicodeDecodeError):
        return None
    return loaded if isinstance(loaded, dict) and isinstance(loaded.get("log_history"), list) else None


def scalar_series(path: str) -> Iterator[Series]:
    """Every scalar series of ``path``, a log other than the dump (``is_dump``)."""
    kind = _kind(path)
    if kind == "directory":
        yield from _directory_series(path)
    elif kind == "events":
        yield from tensorboard_scalars(path)
    elif kind == "csv":
        yield from _csv_series(path, "")
    elif kind == "trainer_state":
        yield from _trainer_state_series(path)


def _directory_series(path: str) -> Iterator[Series]:
    found = list(tensorboard_scalars(path))
    names = [name for pattern in (f"*{TAG_ROOT}_*.csv", f"*{_CSV_LOSS}.csv")
             for name in glob.glob(os.path.join(path, "**", pattern), recursive=True)]
    for name in sorted(names):
        found.extend(_csv_series(name, os.path.relpath(os.path.dirname(name), path)))
    runs = training_runs(found)
    if len(runs) > 1:
        raise LogSourceError(f"{path}: holds {len(runs)} training runs ({', '.join(run or '.' for run in runs)}); "
                             "choose one with --run NAME (or give its folder)")
    if not any(f"{TAG_ROOT}/" in tag for _, tag, _ in found):
        state = _newest_trainer_state(path)
        if state is not None:
            found.extend(_trainer_state_series(state))
    yield from found


def training_run(run: str) -> str:
    """The training run a series' run belongs to: its folder above the writers' runs of buckets and fires (``""``:
    the directory read)."""
    name = _BUCKET_RUNS.sub("", run)
    return "" if name in (".", "") else name


def training_runs(found: List[Series]) -> List[str]:
    """The training runs holding per-bucket statistics among ``found`` (in the order written), runs that continue
    the one before (each beginning at a later step) counted as one. Empty where several writers' tags are there
    (DeepSpeed's monitor's ``Train/Samples/`` beside the Trainer's ``train/``): ``read_layer_series`` refuses
    those, naming the writers."""
    first_steps: Dict[str, int] = {}
    writers = set()
    for run, tag, points in found:
        ours = _OUR_TAG.match(tag)
        if points and ours:
            writers.add(ours.group(1))
            name = training_run(run)
            first_steps[name] = min(first_steps.get(name, points[0][0]), min(step for step, _ in points))
    if len(writers) > 1:
        return []
    starts = list(first_steps.values())
    resumed = all(later > earlier for earlier, later in zip(starts, starts[1:]))
    return list(first_steps)[:1] if resumed else list(first_steps)


def tensorboard_scalars(logdir: str) -> Iterator[Series]:
    """``(run, tag, points)`` of every scalar series under ``logdir`` (or in one events file), read as
    TensorBoard reads them: the points in the order written (by wall time: a run's later event files come
    from a later process), the series in the order they were first written (the writer's order of the layer
    stacks)."""
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
    from tensorboard.plugins.scalar import metadata
    from tensorboard.util import tensor_util

    multiplexer = EventMultiplexer(tensor_size_guidance={metadata.PLUGIN_NAME: 0})
    if os.path.isdir(logdir):
        multiplexer.AddRunsFromDirectory(logdir)
    else:
        multiplexer.AddRun(logdir, ".")
    multiplexer.Reload()
    found = []
    for run, tags in multiplexer.PluginRunToTagToContent(metadata.PLUGIN_NAME).items():
        for tag in tags:
            events = sorted(multiplexer.Tensors(run, tag), key=lambda event: event.wall_time)
            first = events[0].wall_time if events else math.inf
            found.append((first, run, tag, [(event.step, tensor_util.make_ndarray(event.tensor_proto).item())
                                            for event in events]))
    for _, run, tag, points in sorted(found, key=lambda series: series[:3]):
        yield run, tag, points


def _csv_series(path: str, run: str) -> Iterator[Series]:
    """One file of DeepSpeed's CSV monitor: rows ``step,value`` under a header (repeated by a restart)."""
    tag = _csv_tag(os.path.splitext(os.path.basename(path))[0])
    if tag is None:
        return
    points = []
    with open(path, newline="", encoding="utf-8") as rows:
        for row in csv.reader(rows):
            try:
                points.append((int(row[0]), float(row[1])))
            except (ValueError, IndexError):
                continue
    yield run, tag, points


def _csv_tag(name: str) -> Optional[str]:
    """The tag of the CSV monitor's file ``name`` (without ``.csv``), with the writer's prefix the name carries
    (``Train/Samples/``); ``None`` for a file not read here."""
    if name == _CSV_LOSS:
        return MONITOR_LOSS_TAG
    match = _CSV_NAME.search(name)
    skipped = None if match is not None else _CSV_SKIPPED.search(name)
    if match is not None:
        norm_phase, statistic, values_phase, bucket = match.groups()
        tag = f"{scalar_tag(norm_phase or values_phase, statistic or 'norm')}/{bucket}"
    elif skipped is not None:
        tag = SKIPPED_TAG
    else:
        return None
    writer = name[:(match or skipped).start()].replace("_", "/")  # Train_Samples_... : DeepSpeed's Train/Samples/
    return f"{writer}/" * bool(writer) + tag


def _newest_trainer_state(directory: str) -> Optional[str]:
    """The directory's ``trainer_state.json``, or its newest checkpoint's (the highest ``checkpoint-N``)."""
    own = os.path.join(directory, TRAINER_STATE)
    if os.path.isfile(own):
        return own
    checkpoints = glob.glob(os.path.join(directory, "checkpoint-*", TRAINER_STATE))
    numbered = [(int(name.split("checkpoint-")[-1].split(os.sep)[0]), name) for name in checkpoints
                if name.split("checkpoint-")[-1].split(os.sep)[0].isdigit()]
    return max(numbered)[1] if numbered else None


def _trainer_state_series(path: str) -> Iterator[Series]:
    """The numbers of the Trainer's ``log_history``, one series per key, against the entry's ``step``."""
    series: Dict[str, Points] = {}
    for entry in (_trainer_state(path) or {}).get("log_history", []):
        for key, value in entry.items():
            if key != "step" and "step" in entry and isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(key, []).append((entry["step"], float(value)))
    for tag, points in series.items():
        yield "", tag, points
