"""Spike-prone training under ZeRO-2 on CPU: global clipping against per-layer adaptive clipping and skip-step.

    python benchmarks/spike_prone.py [--seeds 0 1 2 3 4] [--arms ...] [--steps N] [--lr LR] [--fault KIND:STEP:SIZE]
                                     [--sweep-lrs LR ...]          # also each arm at these lrs, without faults
    python benchmarks/spike_prone.py --summarize RAW.jsonl ...     # table and figure again from raw runs

A small Pre-LN GPT (``megatron_integration.tiny_gpt``, byte level) learns the Python standard library's own
top-level ``*.py`` sources (about 4.7 MB; every tenth file, in name order, is held out for validation), on one
CPU rank under DeepSpeed ZeRO-2, with AdamW at a learning rate high enough to sit in the unstable part of an lr
sweep (Wortsman et al. 2023, arXiv 2309.14322), and optionally with faults of known size injected at a known step:

- ``data:STEP:LEN``: LEN batches of uniformly random bytes from STEP on (a corrupted shard);
- ``lr:STEP:FACTOR``: the learning rate FACTOR times its schedule's value at STEP only.

Every arm trains from the same initial weights on the same batches for a given seed; only the remedy differs
(``arm_block``). The arms of a seed train in lockstep in one process (each step's batch goes to every arm's engine,
in an order shuffled per step), so an arm's step time over the baseline's at the same step compares two steps
taken within a second of each other, under the same load of the shared machine.

Measured per run: loss spikes (a clean step whose training loss exceeds ``SPIKE_FACTOR`` x the median of the
previous ``SPIKE_WINDOW`` steps), steps lost to recovery (from the end of each spike or fault to the first step
whose next ``RECOVERY_SPAN`` losses average within ``RECOVERY_TOLERANCE`` of the median of the ``SPIKE_WINDOW``
steps before it), the largest loss over its running median, final and best validation loss, skipped and clipped
steps, and the step-time ratio to the baseline. Writes ``benchmarks/results/spike_prone.{md,json}`` (median and
range over seeds per arm) and ``docs/spike_prone.png`` (loss curves, median and range over seeds per arm).
"""

import argparse
import datetime
import glob
import json
import math
import os
import random
import statistics
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from common import RESULTS, machine, write_results

from megatron_integration.tiny_gpt import TinyGPT, TinyGPTConfig

SPIKE_FACTOR = 1.5
SPIKE_WINDOW = 50
RECOVERY_SPAN = 10
RECOVERY_TOLERANCE = 0.05
TIMING_WARMUP = 10
"""Steps left out of the step times (first calls, builds, allocations)."""
FIGURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "spike_prone.png")
BASELINE = "global_clip"
ARM_COLORS = {"global_clip": "tab:blue", "adaptive": "tab:orange", "skip": "tab:green", "both": "tab:red"}
ARM_STYLES = {"global_clip": "-", "adaptive": "--", "skip": ":", "both": "-."}
"""Line styles, so that arms whose curves coincide (skip-step before its first skip) stay visible."""
ARM_LABELS = {
    "global_clip": "global clipping 1.0",
    "adaptive": "per-layer adaptive clipping",
    "skip": "skip-step",
    "both": "adaptive clipping + skip-step",
}


@dataclass
class Fault:
    """A fault of known size: ``data`` (``size`` batches of random bytes from ``step`` on) or ``lr`` (the learning
    rate ``size`` times its schedule's value at ``step``)."""
    kind: str
    step: int
    size: float

    KINDS = ("data", "lr")

    @classmethod
    def parse(cls, text: str) -> "Fault":
        kind, step, size = text.split(":")
        if kind not in cls.KINDS:
            raise argparse.ArgumentTypeError(f"--fault {text}: kind {kind!r} is not one of {cls.KINDS}")
        return cls(kind, int(step), float(size))

    def steps(self) -> range:
        """The steps the fault acts on (1-based)."""
        return range(self.step, self.step + (int(self.size) if self.kind == "data" else 1))

    def shown(self) -> slice:
        """The losses and norms (0-based) that show its size: a data fault's own steps; the step after an lr
        fault (its update has moved the weights)."""
        return slice(self.step - 1, max(self.steps())) if self.kind == "data" else slice(self.step, self.step + 1)


@dataclass
class Plan:
    """Everything a run depends on besides its arm and seed."""
    steps: int = 250
    lr: float = 3e-2
    lr_warmup: int = 20
    num_layers: int = 4
    hidden: int = 96
    heads: int = 4
    seq_len: int = 64
    micro_batch: int = 16
    clip_warmup: int = 50
    """``adaptive_clipping.warmup_steps``: global clipping only before it (scaled from the issue's 100)."""
    skip_window: int = 128
    skip_sigma: float = 6.0
    eval_every: int = 25
    eval_batches: int = 8
    threads: int = 1
    faults: List[Fault] = field(default_factory=list)
    raw: str = "/tmp/spike_prone_raw.jsonl"


DEFAULT_FAULTS = ("data:90:5", "lr:170:20")
"""Five batches of random bytes from step 90, then the learning rate x20 at step 170: each a spike of known size,
after skip-step's window is judged (64 steps) and adaptive clipping's warm-up, and far enough apart for the loss
to settle in between (a few to twenty steps in the baseline)."""


def arm_block(arm: str, plan: Plan) -> Optional[dict]:
    """The arm's ``layer_grad_norms`` block (``None``: the baseline, the feature off)."""
    adaptive = {"adaptive_clipping": {"enabled": True, "beta": 0.98, "factor": 1.05, "warmup_steps": plan.clip_warmup}}
    skip = {"skip_step": {"enabled": True, "sigma": plan.skip_sigma, "window": plan.skip_window}}
    blocks = {"global_clip": None, "adaptive": adaptive, "skip": skip, "both": {**adaptive, **skip}}
    if blocks[arm] is None:
        return None
    return {"enabled": True, **blocks[arm]}


def ds_config(arm: str, plan: Plan) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    block = arm_block(arm, plan)
    if block is not None:
        config["layer_grad_norms"] = block
    return config


# ---------------------------------------------------------------- data


def corpus() -> Tuple[torch.Tensor, torch.Tensor, int]:
    """The standard library's top-level ``*.py`` files as bytes: (train, validation, number of files); every
    tenth file in name order is validation."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    parts: Dict[bool, List[bytes]] = {True: [], False: []}
    for index, path in enumerate(files):
        with open(path, "rb") as handle:
            parts[index % 10 == 9].append(handle.read())
    train, val = (torch.frombuffer(bytearray(b"\n".join(parts[held])), dtype=torch.uint8).long()
                  for held in (False, True))
    return train, val, len(files)


def windows(data: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - length, (count,), generator=generator)
    return torch.stack([data[start:start + length] for start in starts.tolist()])


class Batches:
    """A seed's training batches, the same for every arm; a data fault's steps get random bytes instead."""

    def __init__(self, train: torch.Tensor, plan: Plan, seed: int) -> None:
        self.train, self.plan = train, plan
        self.generator = torch.Generator().manual_seed(seed)
        self.noise = torch.Generator().manual_seed(10**6 + seed)
        self.corrupted = {step for fault in plan.faults if fault.kind == "data" for step in fault.steps()}

    def next(self, step: int) -> torch.Tensor:
        clean = windows(self.train, self.plan.micro_batch, self.plan.seq_len + 1, self.generator)
        if step in self.corrupted:
            return torch.randint(0, 256, clean.shape, generator=self.noise)
        return clean


def lr_factor(plan: Plan):
    """The schedule (linear warm-up, cosine to a tenth) by the schedule's step (0-based): DeepSpeed does not step
    it on a skipped step, so after a skip it lags the global step, as after an fp16 overflow."""

    def factor(index: int) -> float:
        step = index + 1
        warm = min(1.0, step / plan.lr_warmup)
        progress = min(1.0, max(0.0, (step - plan.lr_warmup) / max(1, plan.steps - plan.lr_warmup)))
        return warm * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

    return factor


def lr_jumps(plan: Plan) -> Dict[int, float]:
    """The lr faults' factors by global step (1-based): applied at that step in every arm, whatever it skipped."""
    return {fault.step: fault.size for fault in plan.faults if fault.kind == "lr"}


# ---------------------------------------------------------------- training (inside the launched rank)


def validation_loss(model: torch.nn.Module, batches: Sequence[torch.Tensor]) -> float:
    with torch.no_grad():
        return statistics.fmean(model(batch).item() for batch in batches)


def remedy_record(result: Optional[dict], step: int) -> Tuple[bool, int, float]:
    """From the step's result: whether ``skip_step`` skipped it, how many buckets adaptive clipping scaled down,
    and the smallest factor (1.0: none)."""
    if not result or result.get("step") != step:
        return False, 0, 1.0
    factors = list((result.get("adaptive_clip") or {}).values())
    return bool(result.get("skipped")), sum(factor < 1.0 for factor in factors), min(factors, default=1.0)


class Arm:
    """One arm's engine in a seed's lockstep training, and what its steps recorded."""

    def __init__(self, plan: Plan, arm: str, seed: int) -> None:
        import deepspeed

        torch.manual_seed(seed)
        model = TinyGPT(TinyGPTConfig(vocab_size=256, seq_len=plan.seq_len, hidden=plan.hidden,
                                      num_layers=plan.num_layers, num_heads=plan.heads))
        optimizer = torch.optim.AdamW(model.parameters(), lr=plan.lr, betas=(0.9, 0.95), weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(plan))
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=ds_config(arm, plan))
        self.adapter = getattr(self.engine, "layer_grad_norms", None)
        self.run = {"arm": arm, "seed": seed, "lr": plan.lr, "faulted": bool(plan.faults), "loss": [],
                    "grad_norm": [], "seconds": [], "skipped": [], "clipped_buckets": [], "min_factor": [], "val": []}

    def step(self, step: int, tokens: torch.Tensor, lr_jump: float = 1.0) -> None:
        """One training step, timed from the forward to the end of the optimizer step; its learning rate
        ``lr_jump`` times the schedule's."""
        start = time.perf_counter()
        loss = self.engine(tokens)
        self.engine.backward(loss)
        if self.adapter is not None:
            self.adapter.report_loss(loss.detach())
        if lr_jump == 1.0:
            self.engine.step()
        else:
            self.jumped_step(lr_jump)
        self.run["loss"].append(loss.item())
        self.run["seconds"].append(time.perf_counter() - start)
        self.run["grad_norm"].append(float(self.engine.get_global_grad_norm() or float("nan")))
        result = self.engine.get_layer_grad_norms() if self.adapter is not None else None
        for key, value in zip(("skipped", "clipped_buckets", "min_factor"), remedy_record(result, step)):
            self.run[key].append(value)

    def jumped_step(self, factor: float) -> None:
        """``engine.step()`` with every group's learning rate ``factor`` times its own; the schedule sets the next
        step's after an applied step, and the saved one comes back after a skipped step."""
        groups = self.engine.optimizer.param_groups
        saved = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] *= factor
        self.engine.step()
        for group, lr in zip(groups, saved):
            if group["lr"] == lr * factor:
                group["lr"] = lr


def train_seed(plan: Plan, arms: Sequence[str], seed: int, train: torch.Tensor,
               val_batches: List[torch.Tensor]) -> List[dict]:
    """Every arm of one seed in lockstep: each step's batch goes to every arm's engine in turn, in an order
    shuffled per step, so that neighbouring steps of different arms share the machine's load of the moment and
    their times compare (the step-time ratio). Returns each arm's record."""
    engines = [Arm(plan, arm, seed) for arm in arms]
    batches, shuffler, jumps = Batches(train, plan, seed), random.Random(seed), lr_jumps(plan)
    for step in range(1, plan.steps + 1):
        tokens = batches.next(step)
        for arm in shuffler.sample(engines, len(engines)):
            arm.step(step, tokens, jumps.get(step, 1.0))
        if step % plan.eval_every == 0 or step == plan.steps:
            for arm in engines:
                arm.run["val"].append((step, validation_loss(arm.engine.module, val_batches)))
    for arm in engines:
        arm.engine.destroy()
    return [arm.run for arm in engines]


@dataclass
class Job:
    """One seed's arms in lockstep, at the plan's lr with its faults, or (a sweep point) at ``lr`` without."""
    seed: int
    arms: List[str]
    lr: Optional[float] = None

    def plan(self, plan: Plan) -> Plan:
        return plan if self.lr is None else replace(plan, lr=self.lr, faults=[])


def train_all(plan: Plan, jobs: List[Job]) -> int:
    """Every job in one process, each run appended to ``plan.raw`` as one JSON line as its job ends; returns
    the number of runs."""
    import deepspeed_patch

    deepspeed_patch.install()
    torch.set_num_threads(plan.threads)
    train, val, _ = corpus()
    val_generator = torch.Generator().manual_seed(12345)
    val_batches = [windows(val, 16, plan.seq_len + 1, val_generator) for _ in range(plan.eval_batches)]
    for number, job in enumerate(jobs, 1):
        started = time.time()
        runs = train_seed(job.plan(plan), job.arms, job.seed, train, val_batches)
        with open(plan.raw, "a", encoding="utf-8") as out:
            out.writelines(json.dumps(run) + "\n" for run in runs)
        finals = ", ".join(f"{run['arm']} {run['val'][-1][1]:.3f} ({sum(run['skipped'])} skipped)" for run in runs)
        print(f"[spike_prone] job {number}/{len(jobs)} seed {job.seed} lr {runs[0]['lr']:g}: "
              f"{time.time() - started:.0f} s; final val loss {finals}", file=sys.stderr, flush=True)
    return sum(len(job.arms) for job in jobs)


# ---------------------------------------------------------------- metrics


def spikes(losses: Sequence[float], excluded: set) -> List[int]:
    """Steps (1-based) whose loss exceeds ``SPIKE_FACTOR`` x the median of the previous ``SPIKE_WINDOW``;
    the steps in ``excluded`` (a data fault's own batches) are not counted."""
    return [index + 1 for index in range(SPIKE_WINDOW, len(losses))
            if index + 1 not in excluded
            and losses[index] > SPIKE_FACTOR * statistics.median(losses[index - SPIKE_WINDOW:index])]


def recovery(losses: Sequence[float], first: int, last: int) -> Tuple[int, bool]:
    """Steps after ``last`` (1-based) until the mean of the next ``RECOVERY_SPAN`` losses is within
    ``RECOVERY_TOLERANCE`` of the median of the ``SPIKE_WINDOW`` before ``first``; and whether it got there
    before the run ended (if not, the steps to the end)."""
    before = statistics.median(losses[max(0, first - 1 - SPIKE_WINDOW):first - 1])
    for index in range(last, len(losses) - RECOVERY_SPAN + 1):
        if statistics.fmean(losses[index:index + RECOVERY_SPAN]) <= (1 + RECOVERY_TOLERANCE) * before:
            return index - last, True
    return len(losses) - last, False


def events(spike_steps: List[int], faults: List[Fault]) -> List[Tuple[int, int, str]]:
    """Faults (first and last step they act on) and spikes (their step), as (first, last, kind), in order."""
    return sorted([(min(f.steps()), max(f.steps()), f.kind) for f in faults]
                  + [(step, step, "spike") for step in spike_steps])


def recoveries(losses: Sequence[float], found: List[Tuple[int, int, str]]) -> List[dict]:
    """Each event's recovery (``recovery``); a spike before the end of an earlier event's recovery is part of
    that event, not one of its own."""
    done, until = [], 0
    for first, last, kind in found:
        if kind == "spike" and first <= until:
            continue
        steps, recovered = recovery(losses, first, last)
        until = last + steps
        done.append({"first": first, "last": last, "kind": kind, "steps": steps, "recovered": recovered})
    return done


def run_metrics(run: dict, plan: Plan) -> dict:
    losses = run["loss"]
    corrupted = {step for fault in plan.faults if fault.kind == "data" for step in fault.steps()}
    found = spikes(losses, corrupted)
    recovered = recoveries(losses, events(found, plan.faults))
    ratios = [losses[i] / statistics.median(losses[i - SPIKE_WINDOW:i]) for i in range(SPIKE_WINDOW, len(losses))
              if i + 1 not in corrupted]
    vals = [value for _, value in run["val"]]
    return {"spikes": len(found), "spike_steps": found, "steps_lost": sum(event["steps"] for event in recovered),
            "recoveries": recovered, "max_loss_over_median": max(ratios) if ratios else float("nan"),
            "final_val": vals[-1], "best_val": min(vals), "skipped": sum(run["skipped"]),
            "clipped_steps": sum(count > 0 for count in run["clipped_buckets"]),
            "smallest_factor": statistics.median(run["min_factor"][plan.clip_warmup:]),
            "step_seconds": statistics.median(run["seconds"][TIMING_WARMUP:]),
            "faults": [fault_damage(run, fault, recovered) for fault in plan.faults]}


def fault_damage(run: dict, fault: Fault, recovered: List[dict]) -> dict:
    """One fault in one run: the steps lost to it, the highest loss of the ``RECOVERY_SPAN`` steps after it over
    the median of the ``SPIKE_WINDOW`` before it, and the first validation loss after it."""
    losses, last = run["loss"], max(fault.steps())
    before = statistics.median(losses[max(0, fault.step - 1 - SPIKE_WINDOW):fault.step - 1])
    lost = next(event["steps"] for event in recovered if event["first"] == fault.step and event["kind"] == fault.kind)
    return {"steps_lost": lost, "peak_after": max(losses[last:last + RECOVERY_SPAN]) / before,
            "val_after": next(value for step, value in run["val"] if step > last)}


def step_time_ratio(run: dict, baseline: dict) -> float:
    """The median over steps of a run's step time over the baseline's at the same step (the two ran next to
    each other in the lockstep), the first ``TIMING_WARMUP`` steps left out."""
    pairs = list(zip(run["seconds"], baseline["seconds"]))[TIMING_WARMUP:]
    return statistics.median(mine / base for mine, base in pairs)


def fault_sizes(runs: List[dict], plan: Plan) -> List[dict]:
    """How big each injected fault was in the baseline runs: its loss and global norm over the medians of the
    ``SPIKE_WINDOW`` steps before it (median over seeds)."""
    sizes = []
    for fault in plan.faults:
        loss_x, norm_x = [], []
        for run in runs:
            if run["arm"] != BASELINE or fault.step <= SPIKE_WINDOW:
                continue
            window = slice(fault.step - 1 - SPIKE_WINDOW, fault.step - 1)
            span = fault.shown()
            loss_x.append(max(run["loss"][span]) / statistics.median(run["loss"][window]))
            norm_x.append(max(run["grad_norm"][span]) / statistics.median(run["grad_norm"][window]))
        sizes.append({**asdict(fault), "loss_over_median": statistics.median(loss_x) if loss_x else None,
                      "grad_norm_over_median": statistics.median(norm_x) if norm_x else None})
    return sizes


def spread(values: Sequence[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(runs: List[dict], plan: Plan) -> dict:
    """Per arm: each metric's median and range over seeds, and the step-time ratio to the baseline run of the
    same seed (``step_time_ratio``)."""
    by_key = {(run["arm"], run["seed"]): run for run in runs}
    metrics = {key: run_metrics(run, plan) for key, run in by_key.items()}
    arms = [arm for arm in ARM_LABELS if any(key[0] == arm for key in metrics)]
    summary = {}
    for arm in arms:
        mine = {seed: value for (name, seed), value in metrics.items() if name == arm}
        row = {key: spread([value[key] for value in mine.values()])
               for key in ("spikes", "steps_lost", "max_loss_over_median", "final_val", "best_val", "skipped",
                           "clipped_steps", "smallest_factor", "step_seconds")}
        ratios = [step_time_ratio(by_key[(arm, seed)], by_key[(BASELINE, seed)]) for seed in mine
                  if (BASELINE, seed) in by_key]
        row["cost_ratio"] = spread(ratios) if ratios else None
        row["faults"] = [{key: spread([value["faults"][index][key] for value in mine.values()])
                          for key in ("steps_lost", "peak_after", "val_after")} for index in range(len(plan.faults))]
        row["per_seed"] = {seed: mine[seed] for seed in sorted(mine)}
        summary[arm] = row
    return summary


# ---------------------------------------------------------------- report and figure


def cell(values: dict, digits: int = 3) -> str:
    if values is None:
        return "n/a"
    return f"{values['median']:.{digits}f} ({values['min']:.{digits}f}-{values['max']:.{digits}f})"


def report(summary: dict, plan: Plan, sizes: List[dict], setup: dict) -> List[str]:
    seeds = sorted({seed for row in summary.values() for seed in row["per_seed"]})
    lines = [
        "# Spike-prone runs: global clipping, per-layer adaptive clipping, skip-step",
        "",
        "Made by " + " and ".join(f"`python benchmarks/spike_prone.py {argv}` (started {date})"
                                  for argv, date in setup["commands"]) + f"; summarized on {setup['date']}.",
        "",
        f"- Model: tiny Pre-LN GPT (`megatron_integration/tiny_gpt.py`), {plan.num_layers} layers, hidden "
        f"{plan.hidden}, {plan.heads} heads, byte level (vocabulary 256), sequence {plan.seq_len}, "
        f"{setup['parameters'] / 1e6:.2f} M parameters.",
        f"- Data: the Python standard library's top-level `*.py` files ({setup['files']} files, "
        f"{setup['train_bytes'] / 1e6:.2f} MB train, {setup['val_bytes'] / 1e6:.2f} MB validation: every tenth "
        f"file held out); micro-batch {plan.micro_batch} random windows a step, the same for every arm of a seed; "
        f"validation loss on {plan.eval_batches} x 16 fixed held-out windows every {plan.eval_every} steps.",
        f"- Training: DeepSpeed ZeRO-2, 1 CPU rank, fp32, torch AdamW (betas 0.9/0.95, weight decay 0.1), "
        f"lr {plan.lr:g} (linear warm-up {plan.lr_warmup} steps, cosine to a tenth), {plan.steps} steps, "
        f"gradient_clipping 1.0 in every arm; seeds {seeds} (initial weights and batch order).",
        f"- Arms: adaptive clipping `beta 0.98, factor 1.05, warmup_steps {plan.clip_warmup}`; skip-step "
        f"`sigma {plan.skip_sigma:g}, window {plan.skip_window}`; both: the two blocks together.",
        "- Faults: " + ("; ".join(fault_line(size) for size in sizes) if sizes else "none") + ".",
        f"- Machine: {setup['machine']}; {plan.threads} torch thread(s).",
        "",
        f"Spikes: clean steps whose training loss exceeds {SPIKE_FACTOR}x the median of the previous {SPIKE_WINDOW} "
        f"steps (a data fault's own batches are not counted). Steps lost: for each spike or fault, the steps from "
        f"its end to the first step whose next {RECOVERY_SPAN} losses average within {RECOVERY_TOLERANCE:.0%} of "
        f"the median of the {SPIKE_WINDOW} steps before it (to the run's end if never), summed over the run. "
        "Clipped steps: steps where adaptive clipping scaled at least one bucket (layer, embedding, head...) down; "
        "smallest factor: the median over the steps after its warm-up of the step's smallest bucket factor. "
        "Step time ratio: the median "
        f"over steps (after the {TIMING_WARMUP}th) of the arm's step time over the baseline's at the same step, "
        "taken next to each other in the lockstep (forward, backward and optimizer step; validation excluded); "
        "the baseline runs with the feature off. Cells: median (min-max) over seeds.",
        "",
        "| arm | spikes | steps lost | max loss / running median | final val loss | best val loss | skipped steps "
        "| clipped steps | smallest factor | step time ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm, row in summary.items():
        lines.append(f"| {ARM_LABELS[arm]} | {cell(row['spikes'], 0)} | {cell(row['steps_lost'], 0)} | "
                     f"{cell(row['max_loss_over_median'])} | {cell(row['final_val'])} | {cell(row['best_val'])} | "
                     f"{cell(row['skipped'], 0)} | {cell(row['clipped_steps'], 0)} | "
                     f"{cell(row['smallest_factor'], 2)} | {cell(row['cost_ratio'], 2)} |")
    lines += fault_table(summary, plan)
    lines += ["", "Per seed (final validation loss / steps lost):", ""]
    for arm, row in summary.items():
        per_seed = ", ".join(f"seed {seed}: {value['final_val']:.3f} / {value['steps_lost']}"
                             for seed, value in row["per_seed"].items())
        lines.append(f"- {ARM_LABELS[arm]}: {per_seed}")
    lines += ["", "Figure: [docs/spike_prone.png](../../docs/spike_prone.png). Raw runs: spike_prone.json, written "
              "beside this table (not kept in git)."]
    return lines


def fault_table(summary: dict, plan: Plan) -> List[str]:
    """Each fault's damage per arm: steps lost, the highest loss of the next steps over the median before, and
    the first validation loss after it."""
    if not plan.faults:
        return []
    lines = ["", f"Each fault alone: steps lost to it; the highest training loss of the {RECOVERY_SPAN} steps after "
             f"it over the median of the {SPIKE_WINDOW} before it; the first validation loss after it.", ""]
    header, rule = "| arm |", "| --- |"
    for fault in plan.faults:
        name = f"{fault.kind} fault at {fault.step}"
        header += f" {name}: steps lost | peak after | val loss after |"
        rule += " --- | --- | --- |"
    lines += [header, rule]
    for arm, row in summary.items():
        cells = [f"{cell(f['steps_lost'], 0)} | {cell(f['peak_after'], 2)} | {cell(f['val_after'])}"
                 for f in row["faults"]]
        lines.append(f"| {ARM_LABELS[arm]} | " + " | ".join(cells) + " |")
    return lines


def fault_line(size: dict) -> str:
    if size["kind"] == "data":
        what = f"{int(size['size'])} batch(es) of uniformly random bytes from step {size['step']}"
    else:
        what = f"learning rate x{size['size']:g} at step {size['step']}"
    if size["loss_over_median"] is None:
        return what
    return (f"{what} (in the baseline: loss {size['loss_over_median']:.2f}x and global gradient norm "
            f"{size['grad_norm_over_median']:.1f}x their medians of the {SPIKE_WINDOW} steps before)")


def band(curves: List[List[float]]) -> Tuple[List[float], List[float], List[float]]:
    columns = list(zip(*curves))
    return ([statistics.median(c) for c in columns], [min(c) for c in columns], [max(c) for c in columns])


def smooth(values: Sequence[float], excluded: set, span: int = RECOVERY_SPAN) -> List[float]:
    """The mean of the last ``span`` values, those of the steps in ``excluded`` (1-based) left out: a data
    fault's random bytes, whose loss says nothing of the model's state (NaN where only they remain)."""
    kept = [math.nan if index + 1 in excluded else value for index, value in enumerate(values)]
    means = []
    for index in range(len(kept)):
        window = [value for value in kept[max(0, index - span + 1):index + 1] if not math.isnan(value)]
        means.append(statistics.fmean(window) if window else math.nan)
    return means


def plot(runs: List[dict], plan: Plan, sweep: List[dict], path: str = FIGURE) -> None:
    """Six panels, median and range over seeds per arm: the training loss (mean of the last ``RECOVERY_SPAN``
    steps); the loss step by step around each of the first two faults; the validation loss; the lr sweep's final
    validation loss; the smallest adaptive factor of each step, and the skipped steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    corrupted = {step for fault in plan.faults if fault.kind == "data" for step in fault.steps()}
    (full, *zooms), (val_ax, sweep_ax, remedy_ax) = axes
    for arm in [arm for arm in ARM_LABELS if any(run["arm"] == arm for run in runs)]:
        mine = [run for run in runs if run["arm"] == arm]
        draw_band(full, [smooth(run["loss"], corrupted) for run in mine], arm)
        for zoom in zooms:
            draw_band(zoom, [run["loss"] for run in mine], arm)
        val_steps = [step for step, _ in mine[0]["val"]]
        draw_band(val_ax, [[value for _, value in run["val"]] for run in mine], arm, val_steps)
        if arm in ("adaptive", "both"):
            draw_band(remedy_ax, [run["min_factor"] for run in mine], arm)
        skips = [step for run in mine for step, skipped in enumerate(run["skipped"], 1) if skipped]
        if skips:
            remedy_ax.plot(skips, [1.1 + 0.05 * list(ARM_LABELS).index(arm)] * len(skips), "|", color=ARM_COLORS[arm],
                           markersize=10, label=f"{ARM_LABELS[arm]}: skipped steps (all seeds)")
    full.set_title(f"training loss, lr {plan.lr:g}\n({RECOVERY_SPAN}-step mean, random-byte batches left out)")
    for fault in plan.faults:
        full.axvspan(fault.step, max(fault.steps()) + 1, color="red", alpha=0.1)
    for zoom, fault in zip(zooms, plan.faults):
        zoom_on(zoom, fault, runs)
    for zoom in zooms[len(plan.faults):]:
        zoom.axis("off")
    val_ax.set_title("validation loss")
    sweep_panel(sweep_ax, sweep)
    remedy_ax.set_title("smallest adaptive factor of each step\nand the skipped steps")
    remedy_ax.set_yscale("log")
    for ax in (full, *zooms, val_ax, remedy_ax):
        ax.set_xlabel("step")
    for ax in (full, *zooms, val_ax):
        ax.set_ylabel("loss (nats/byte)")
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower left" if ax is remedy_ax else "best")
    seeds = len({run["seed"] for run in runs})
    fig.suptitle(f"Tiny Pre-LN GPT ({plan.num_layers} layers, hidden {plan.hidden}), ZeRO-2, Python stdlib bytes: "
                 f"median and range over {seeds} seeds per arm", fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)


def draw_band(ax, curves: List[List[float]], arm: str, xs: Optional[List[int]] = None) -> None:
    """The median of ``curves`` as the arm's line, their range as a band of its colour."""
    median, low, high = band(curves)
    xs = xs or list(range(1, len(median) + 1))
    ax.plot(xs, median, color=ARM_COLORS[arm], linestyle=ARM_STYLES[arm], label=ARM_LABELS[arm], linewidth=1.2,
            marker="." if len(xs) < 30 else None)
    ax.fill_between(xs, low, high, color=ARM_COLORS[arm], alpha=0.15)


def zoom_on(ax, fault: Fault, runs: List[dict]) -> None:
    """The losses step by step from 15 steps before ``fault`` to 45 after its last step."""
    first, last = fault.step - 15, max(fault.steps()) + 45
    ax.set_xlim(first, last)
    ax.axvspan(fault.step, max(fault.steps()) + 1, color="red", alpha=0.1)
    clean = [loss for run in runs for step, loss in enumerate(run["loss"], 1)
             if first <= step <= last and step not in (fault.steps() if fault.kind == "data" else ())]
    ax.set_ylim(min(clean) * 0.95, max(clean) * 1.05)
    what = f"{int(fault.size)} random-byte batches" if fault.kind == "data" else f"lr x{fault.size:g}"
    ax.set_title(f"loss per step around the fault at step {fault.step}\n({what})")


def sweep_panel(ax, sweep: List[dict]) -> None:
    ax.set_title("lr sweep without faults\nfinal validation loss")
    if not sweep:
        ax.axis("off")
        return
    for arm in [arm for arm in ARM_LABELS if any(row["arm"] == arm for row in sweep)]:
        rows = [row for row in sweep if row["arm"] == arm]
        lrs = [row["lr"] for row in rows]
        median = [row["final_val"]["median"] for row in rows]
        errors = [[m - row["final_val"]["min"] for m, row in zip(median, rows)],
                  [row["final_val"]["max"] - m for m, row in zip(median, rows)]]
        ax.errorbar(lrs, median, yerr=errors, marker="o", color=ARM_COLORS[arm], linestyle=ARM_STYLES[arm],
                    label=ARM_LABELS[arm], capsize=3)
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final validation loss")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def read_raw(paths: Sequence[str]) -> Tuple[Plan, List[dict], List[dict]]:
    """The plan of the first file, the runs (one a line after each file's header) and the headers (plan, the
    command's arguments, when it started) of raw files."""
    headers, runs = [], []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            header, *mine = [json.loads(line) for line in handle if line.strip()]
        headers.append(header)
        runs += mine
    plan = dict(headers[0]["plan"])
    faults = [Fault(**fault) for fault in plan.pop("faults")]
    return Plan(**plan, faults=faults), runs, headers


def write_all(runs: List[dict], plan: Plan, headers: List[dict], name: str = "spike_prone") -> str:
    """The table, the JSON (plan, summary, every run's curves) and the figure; returns the table."""
    train, val, files = corpus()
    parameters = sum(p.numel() for p in TinyGPT(TinyGPTConfig(
        vocab_size=256, seq_len=plan.seq_len, hidden=plan.hidden, num_layers=plan.num_layers,
        num_heads=plan.heads)).parameters())
    setup = {"commands": [(header["argv"], header["date"]) for header in headers], "date": now(),
             "machine": machine(), "files": files, "train_bytes": len(train), "val_bytes": len(val),
             "parameters": parameters}
    main_runs = [run for run in runs if is_main(run, plan)]
    summary, sizes, sweep = summarize(main_runs, plan), fault_sizes(main_runs, plan), sweep_summary(runs, plan)
    lines = report(summary, plan, sizes, setup) + sweep_report(sweep, plan)
    write_results(name, lines)
    with open(os.path.join(RESULTS, f"{name}.json"), "w", encoding="utf-8") as out:  # compact: every step of every run
        json.dump({"plan": asdict(plan), "setup": setup, "faults": sizes, "summary": summary, "sweep": sweep,
                   "runs": [rounded(run) for run in runs]}, out, separators=(",", ":"))
    if main_runs:
        plot(main_runs, plan, sweep)
    return "\n".join(lines)


def rounded(run: dict) -> dict:
    """A run's per-step series to 4 significant digits, for the JSON file (the raw file keeps them whole)."""
    return {key: [float(f"{value:.4g}") if isinstance(value, float) else value for value in values]
            if isinstance(values, list) and key != "val" else values for key, values in run.items()}


def is_main(run: dict, plan: Plan) -> bool:
    """Whether a run belongs to the arms' comparison (the plan's lr and faults), not to the lr sweep."""
    return run.get("lr", plan.lr) == plan.lr and run.get("faulted", bool(plan.faults)) == bool(plan.faults)


def sweep_summary(runs: List[dict], plan: Plan) -> List[dict]:
    """The runs without faults by arm and learning rate: final and best validation loss, spikes and the largest
    loss over its running median, each as median and range over seeds (Wortsman et al.'s lr sensitivity)."""
    groups: Dict[Tuple[str, float], List[dict]] = {}
    for run in runs:
        if not run.get("faulted", bool(plan.faults)):
            metrics = run_metrics(run, replace(plan, faults=[]))
            groups.setdefault((run["arm"], run.get("lr", plan.lr)), []).append(metrics)
    return [{"arm": arm, "lr": lr, **{key: spread([m[key] for m in found])
                                      for key in ("final_val", "best_val", "spikes", "max_loss_over_median")}}
            for (arm, lr), found in sorted(groups.items(), key=lambda item: (list(ARM_LABELS).index(item[0][0]),
                                                                              item[0][1]))]


def sweep_report(sweep: List[dict], plan: Plan) -> List[str]:
    if not sweep:
        return []
    lines = ["", "## Learning-rate sweep, no faults", "",
             f"The same runs without injected faults, {plan.steps} steps, at each learning rate: where the final loss "
             "rises with the learning rate, training is in its unstable region (Wortsman et al. 2023).", "",
             "| arm | lr | seeds | final val loss | best val loss | spikes | max loss / running median |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in sweep:
        lines.append(f"| {ARM_LABELS[row['arm']]} | {row['lr']:g} | {row['final_val']['n']} | "
                     f"{cell(row['final_val'])} | {cell(row['best_val'])} | {cell(row['spikes'], 0)} | "
                     f"{cell(row['max_loss_over_median'])} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", nargs="+", default=list(ARM_LABELS), choices=list(ARM_LABELS))
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--fault", action="append", type=Fault.parse,
                        help=f"data:STEP:LEN (random-byte batches) or lr:STEP:FACTOR; repeatable (default: "
                        f"{' '.join(DEFAULT_FAULTS)})")
    parser.add_argument("--no-faults", action="store_true", help="no injected fault")
    parser.add_argument("--sweep-lrs", nargs="*", type=float, default=[],
                        help="also run --sweep-arms at these learning rates, without faults")
    parser.add_argument("--sweep-arms", nargs="+", default=[BASELINE], choices=list(ARM_LABELS))
    parser.add_argument("--sweep-seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--summarize", metavar="RAW", nargs="+",
                        help="only rebuild the table and figure from these raw files (the first one's plan)")
    parser.add_argument("--name", default="spike_prone", help="result file name in benchmarks/results")
    for key, value in asdict(Plan()).items():
        if key not in ("faults",):
            parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args()
    faults = [] if args.no_faults else args.fault or [Fault.parse(text) for text in DEFAULT_FAULTS]
    plan = Plan(**{key: getattr(args, key) for key in asdict(Plan()) if key != "faults"}, faults=faults)
    argv = " ".join(sys.argv[1:])
    if not args.summarize:
        from megatron_integration.cpu_launch import launch

        with open(plan.raw, "w", encoding="utf-8") as out:
            out.write(json.dumps({"plan": asdict(plan), "argv": argv, "date": now()}) + "\n")
        jobs = [Job(seed, args.arms) for seed in args.seeds]
        jobs += [Job(seed, args.sweep_arms, lr) for lr in args.sweep_lrs for seed in args.sweep_seeds]
        launch(train_all, 1, plan, jobs, timeout=6 * 3600)
    plan, runs, headers = read_raw(args.summarize or [plan.raw])
    print(write_all(runs, plan, headers, args.name))


if __name__ == "__main__":
    main()
