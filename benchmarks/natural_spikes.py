"""Natural spikes: does ``report``'s answer hold on spikes nobody injected? Issue 44's suite.

    python3 benchmarks/natural_spikes.py run [--mechanisms slingshot ...] [--seeds 0 1 2 3 4] [--steps N] [--out DIR]
    python3 benchmarks/natural_spikes.py probe MECHANISM [--seeds 0] [--steps N] [--set KEY=VALUE ...] [--out DIR]
    python3 benchmarks/natural_spikes.py evaluate [DIR]   # runs/natural -> results/natural_spikes.md

``run`` trains each mechanism of ``spike_mechanisms`` at each seed under DeepSpeed ZeRO-2 on 2 CPU ranks, with every
layer, the four optimizer statistics, the grad-norm and loss triggers and a 16-step flight recorder; each run
writes ``DIR/<mechanism>-<seed>/``: the feature's JSONL dump, the ground truth (``truth.jsonl``: every bucket's
float64 norm of the gradient, the update and Adam's moments, every step, computed beside DeepSpeed by
``spike_mechanisms.GroundTruth``, not by the package) and the run's record. ``probe`` trains a mechanism (or a
variant of it) in plain PyTorch on one process and appends which loss jumps it had to ``DIR/probes.jsonl``: the
quick way to find settings that spike. ``evaluate`` reads the saved runs, runs the CURRENT ``report`` code on each dump
(``megatron_integration.spike.spike_summaries``) and the ground-truth rule below on each truth, and tabulates
every fire.

The ground-truth rule (``truth_answer``), for one fire of the trigger at step F:

1. The loss spike is the first step S in ``[F - LOOK_BACK, F + LOOK_BACK]`` whose loss is above ``LOSS_JUMP`` times
   the median of the ``LOSS_WINDOW`` steps before it (none: the fire had no loss spike, and S is F).
2. A signal of a bucket (the gradient, ``exp_avg``, ``exp_avg_sq``, the update; every bucket, those outside the
   layers included) leaves its level at step t when its norm there is above ``DEPARTURE`` times its level, the
   median of its norms over the ``LEVEL_STEPS`` steps before t, or non-finite. One threshold for every signal.
3. The answer is the earliest step t in ``[S - LOOK_BACK, S]`` at which any signal of any bucket left its level;
   at one step, the gradient before the moments before the update (Adam's order of cause: the moments and the
   update are computed from the gradient); the buckets whose that signal left at t are named, the largest rise
   first. The look-back is bounded: nothing before ``S - LOOK_BACK`` is a cause.

The lead time of a fire is S minus the first step in ``[S - LOOK_BACK, S]`` at which any bucket's gradient left its
level: how early a per-bucket gradient watch would have warned. The report agrees with the truth where it names
the same signal, a bucket among those the truth names, and a step within ``STEP_TOLERANCE`` of the truth's; a fire
the report says continues an earlier fire of the same loss spike is judged by that fire's claim (one incident).
The rule's noise (how often a quiet step departs) is in the results' last table.
"""

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import asdict, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from common import RESULTS
from spike_mechanisms import MECHANISMS, RunSpec, train_all, train_plain

LOSS_JUMP = 3.0
LOSS_WINDOW = 50
DEPARTURE = 2.0
LEVEL_STEPS = 16
LOOK_BACK = 16
"""Steps before the loss spike a cause may lie in: the recorder's history (``trigger.history``)."""
STEP_TOLERANCE = 2
SIGNALS = ("grad", "exp_avg", "exp_avg_sq", "update")
"""The ground truth's signals, in the order that breaks a tie at one step."""
REPORT_SIGNAL = {"pre_clip": "grad", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "update": "update"}
"""The report's signal names (the result's keys) as the ground truth's."""
DEFAULT_OUT = "runs/natural"
WORLD_SIZE = 2


# ---------------------------------------------------------------- ground truth


def loss_jumps(losses: Sequence[float]) -> List[int]:
    """Steps (1-based) whose loss is above ``LOSS_JUMP`` times the median of the ``LOSS_WINDOW`` before it."""
    return [index + 1 for index in range(LOSS_WINDOW, len(losses))
            if not losses[index] <= LOSS_JUMP * statistics.median(losses[index - LOSS_WINDOW:index])]


def episodes(jumps: Sequence[int], gap: int = LOOK_BACK) -> List[int]:
    """The first step of each run of jumps (jumps within ``gap`` steps of the previous one continue it)."""
    starts: List[int] = []
    for step, previous in zip(jumps, [None, *jumps]):
        if previous is None or step - previous > gap:
            starts.append(step)
    return starts


def read_truth(path: str) -> List[Dict[str, Any]]:
    """The truth's lines, indexed by step - 1 (every step is logged)."""
    with open(path, encoding="utf-8") as handle:
        lines = [json.loads(line) for line in handle if line.strip()]
    if [line["step"] for line in lines] != list(range(1, len(lines) + 1)):
        raise ValueError(f"{path}: the ground truth does not hold every step from 1")
    return lines


def departure(values: Sequence[float], index: int) -> Optional[float]:
    """The rise over its level (``LEVEL_STEPS`` before it) at which ``values[index]`` left it (inf: non-finite);
    ``None`` where it did not, or has no level."""
    level_values = [value for value in values[max(0, index - LEVEL_STEPS):index] if math.isfinite(value)]
    value = values[index]
    if not math.isfinite(value):
        return math.inf
    if len(level_values) < LEVEL_STEPS // 2:
        return None
    level = statistics.median(level_values)
    rise = value / level if level > 0 else (math.inf if value > 0 else 1.0)
    return rise if rise > DEPARTURE else None


def departures_at(truth: List[Dict[str, Any]], step: int, signal: str) -> Dict[str, float]:
    """Each bucket whose ``signal`` left its level at ``step``, with its rise."""
    found = {}
    for bucket in truth[step - 1][signal]:
        values = [line[signal].get(bucket, math.nan) for line in truth[:step]]
        rise = departure(values, step - 1)
        if rise is not None:
            found[bucket] = rise
    return found


def first_departure(truth: List[Dict[str, Any]], spike: int,
                    signals: Sequence[str] = SIGNALS) -> Optional[Dict[str, Any]]:
    """The earliest departure of ``signals`` in ``[spike - LOOK_BACK, spike]`` (rule 3 of the module's docstring):
    ``signal``, ``buckets`` (largest rise first), ``rises``, ``step``; ``None`` where none left its level."""
    for step in range(max(1, spike - LOOK_BACK), spike + 1):
        for signal in signals:
            found = departures_at(truth, step, signal)
            if found:
                buckets = sorted(found, key=lambda bucket: -found[bucket])
                return {"signal": signal, "buckets": buckets, "rises": [found[b] for b in buckets], "step": step}
    return None


def loss_spike_of(losses: Sequence[float], fired_at: int) -> Optional[int]:
    """Rule 1: the first loss jump within ``LOOK_BACK`` steps of the fire, either side."""
    return next((step for step in loss_jumps(losses)
                 if fired_at - LOOK_BACK <= step <= fired_at + LOOK_BACK), None)


def truth_answer(truth: List[Dict[str, Any]], fired_at: int) -> Dict[str, Any]:
    """The ground truth of one fire: its loss spike, the first departure before it, and the lead time."""
    losses = [line["loss"] for line in truth]
    spike = loss_spike_of(losses, fired_at)
    reference = fired_at if spike is None else min(spike, len(truth))
    first = first_departure(truth, reference)
    gradient = first_departure(truth, reference, ("grad", ))
    return {"loss_spike": spike, "first": first,
            "lead": None if spike is None or gradient is None else spike - gradient["step"]}


# ---------------------------------------------------------------- the report's answer


def report_answers(dump: str) -> List[Dict[str, Any]]:
    """The CURRENT report's claim for each fire of ``dump``: ``fired_at`` and ``claim`` (the verdict, or
    ``None``)."""
    from megatron_integration.spike import spike_summaries

    return [{"fired_at": spike["fired_at"], "reason": spike.get("reason"),
             "claim": (spike.get("attribution") or {}).get("verdict"), "answer": spike["answer"]}
            for spike in spike_summaries(dump)]


def agreement(claim: Optional[Dict[str, Any]], first: Optional[Dict[str, Any]], fired_at: int) -> Tuple[bool, str]:
    """Whether the report's claim agrees with the truth's first departure, and, where not, why (each way it
    differs, named)."""
    if claim is None or first is None:
        return claim is None and first is None, ("" if claim is None and first is None else
                                                 "no answer" if claim is None else "the truth found no departure")
    reasons = []
    signal = REPORT_SIGNAL.get(claim["signal"], claim["signal"])
    if signal != first["signal"]:
        reasons.append(f"signal ({signal}, the truth's {first['signal']}"
                       + (": a running average named ahead of the gradient)" if first["signal"] == "grad" and
                          signal in ("exp_avg", "exp_avg_sq") else ")"))
    if not {str(layer) for layer in claim["layers"]} & set(first["buckets"]):
        outside = not any(bucket.isdigit() for bucket in first["buckets"])
        reasons.append("bucket" + (" (the truth's are outside the layers)" if outside else ""))
    if fired_at - claim["step"] > LOOK_BACK:
        reasons.append(f"step (dated {fired_at - claim['step']} steps before its fire, beyond the look-back)")
    elif abs(claim["step"] - first["step"]) > STEP_TOLERANCE:
        reasons.append(f"step ({claim['step']}, the truth's {first['step']})")
    return not reasons, "; ".join(reasons)


def evaluate_run(folder: str) -> List[Dict[str, Any]]:
    """One row per fire of a run: the report's answer, the truth's, whether they agree, the lead time. A fire the
    report says continues an earlier fire of the same loss spike is one incident: it is judged by the claim of the
    fire it continues (``judged_by``), which the report's line carries on."""
    truth = read_truth(os.path.join(folder, "truth.jsonl"))
    mechanism, _, seed = os.path.basename(folder.rstrip("/")).rpartition("-")
    rows: List[Dict[str, Any]] = []
    for answer in report_answers(os.path.join(folder, "dump.jsonl")):
        expected = truth_answer(truth, answer["fired_at"])
        judged_by = _incident_start(rows, answer["claim"], expected["loss_spike"]) or answer
        agree, why = agreement(judged_by["claim"], expected["first"], judged_by["fired_at"])
        rows.append({"mechanism": mechanism, "seed": int(seed), **answer, **expected, "agree": agree, "why": why,
                     "judged_by": judged_by["fired_at"]})
    return rows


def _incident_start(rows: List[Dict[str, Any]], claim: Optional[Dict[str, Any]],
                    loss_spike: Optional[int]) -> Optional[Dict[str, Any]]:
    """The row of the fire ``claim`` continues, where it had the same loss spike (and that fire's own start)."""
    continues = (claim or {}).get("continues")
    earlier = next((row for row in rows if row["fired_at"] == continues), None)
    if earlier is None or loss_spike is None or earlier["loss_spike"] != loss_spike:
        return None
    return next(row for row in rows if row["fired_at"] == earlier["judged_by"])


def run_folders(root: str) -> List[str]:
    """The finished runs under ``root`` (those with their ``record.json``), in name order."""
    return sorted(os.path.join(root, name) for name in os.listdir(root)
                  if os.path.exists(os.path.join(root, name, "record.json")))


# ---------------------------------------------------------------- tables


def _claim_cell(claim: Optional[Dict[str, Any]]) -> str:
    if claim is None:
        return "none"
    where = ", ".join(str(layer) for layer in claim["layers"])
    return f"{REPORT_SIGNAL.get(claim['signal'], claim['signal'])} of {where} @{claim['step']}"


def _truth_cell(first: Optional[Dict[str, Any]]) -> str:
    if first is None:
        return "none"
    buckets = ", ".join(f"{bucket} ({rise:.1f}x)" for bucket, rise in
                        zip(first["buckets"][:3], first["rises"][:3]))
    more = f" +{len(first['buckets']) - 3}" if len(first["buckets"]) > 3 else ""
    return f"{first['signal']} of {buckets}{more} @{first['step']}"


def _continues(row: Dict[str, Any]) -> str:
    return "" if row["judged_by"] == row["fired_at"] else f" (continues {row['judged_by']}: judged by its claim)"


def fire_table(rows: List[Dict[str, Any]]) -> List[str]:
    lines = ["| mechanism | seed | fire | reason | loss spike | report: signal of buckets @step | "
             "truth: signal of buckets @step | agree | lead |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['mechanism']} | {row['seed']} | {row['fired_at']} | {row['reason'] or ''} | "
                     f"{row['loss_spike'] or '-'} | {_claim_cell(row['claim'])}{_continues(row)} | "
                     f"{_truth_cell(row['first'])} | "
                     f"{'yes' if row['agree'] else 'no: ' + row['why']} | "
                     f"{'-' if row['lead'] is None else row['lead']} |")
    return lines


def summary_table(rows: List[Dict[str, Any]], runs: Dict[str, List[Tuple[int, int]]]) -> List[str]:
    """Per mechanism: its runs (seed and steps), fires, agreement and lead time."""
    lines = ["| mechanism | seeds (steps) | fires | with loss spike | agree | report dated > look-back before the "
             "fire | lead time per loss spike, median (range) |", "|---|---|---|---|---|---|---|"]
    for mechanism, seeds in runs.items():
        shown = ", ".join(f"{seed} ({steps})" for seed, steps in seeds)
        mine = [row for row in rows if row["mechanism"] == mechanism]
        incidents = {(row["seed"], row["loss_spike"]): row["lead"] for row in mine if row["lead"] is not None}
        leads = list(incidents.values())  # one per loss spike, however many fires it had
        early = sum(1 for row in mine if row["claim"] and row["fired_at"] - row["claim"]["step"] > LOOK_BACK)
        lead = f"{statistics.median(leads):g} ({min(leads)}-{max(leads)})" if leads else "-"
        lines.append(f"| {mechanism} | {len(seeds)}: {shown} | {len(mine)} | "
                     f"{sum(row['loss_spike'] is not None for row in mine)} | "
                     f"{sum(row['agree'] for row in mine)} of {len(mine)} | {early} | {lead} |")
    return lines


def mechanism_table() -> List[str]:
    """Each mechanism's settings where they differ from the slingshot's, and its source."""
    base = asdict(MECHANISMS["slingshot"])
    lines = ["| mechanism | settings (besides the slingshot's) | after |", "|---|---|---|"]
    for mechanism in MECHANISMS.values():
        changed = {key: value for key, value in asdict(mechanism).items()
                   if key not in ("name", "citation") and value != base[key]}
        settings = ", ".join(f"{key} {value}" for key, value in changed.items()) or (
            f"lr {base['lr']}, betas {base['betas']}, weight decay {base['weight_decay']}, batch {base['batch']}, "
            f"{base['num_layers']} layers of width {base['hidden']}, {base['heads']} heads")
        lines.append(f"| {mechanism.name} | {settings} | {mechanism.citation} |")
    return lines


QUIET_FROM = 300
"""Quiet steps, where the rule's noise is measured: from this step, and not within ``QUIET_MARGIN`` of a loss jump."""
QUIET_MARGIN = (20, 40)


def quiet_rises(truth: List[Dict[str, Any]], signal: str) -> List[float]:
    """Each bucket's norm of ``signal`` over its level (the median of the ``LEVEL_STEPS`` before), at the quiet
    steps of a run: how far the rule's ``DEPARTURE`` is above the noise."""
    near = {step for jump in loss_jumps([line["loss"] for line in truth])
            for step in range(jump - QUIET_MARGIN[0], jump + QUIET_MARGIN[1])}
    rises = []
    for bucket in truth[0][signal]:
        values = [line[signal][bucket] for line in truth]
        rises += [values[index] / statistics.median(values[index - LEVEL_STEPS:index])
                    for index in range(QUIET_FROM, len(values)) if index + 1 not in near]
    return rises


def noise_table(folders: Sequence[str]) -> List[str]:
    """Per signal, over every run's quiet steps and buckets: the 99th percentile and the largest rise, and how
    many bucket-steps were above ``DEPARTURE`` (false departures of the rule)."""
    truths = [read_truth(os.path.join(folder, "truth.jsonl")) for folder in folders]
    lines = [f"| signal | quiet bucket-steps | 99th percentile | largest | above {DEPARTURE:g}x |",
             "|---|---|---|---|---|"]
    for signal in SIGNALS:
        rises = sorted(rise for truth in truths for rise in quiet_rises(truth, signal))
        if rises:
            lines.append(f"| {signal} | {len(rises)} | {rises[int(0.99 * len(rises))]:.2f} | "
                         f"{rises[-1]:.2f} | {sum(rise > DEPARTURE for rise in rises)} |")
    return lines


def probe_table(path: str) -> List[str]:
    """The plain-PyTorch probes: which settings spiked (loss jumps, ``loss_jumps`` collapsed to episodes)."""
    if not os.path.exists(path):
        return []
    lines = ["| mechanism | settings | seed | steps | loss-jump episodes (first steps) | held-out accuracy, end |",
             "|---|---|---|---|---|---|"]
    with open(path, encoding="utf-8") as handle:
        for probe in map(json.loads, handle):
            settings = ", ".join(f"{key} {value}" for key, value in probe["settings"].items()) or "as defined"
            lines.append(f"| {probe['mechanism']} | {settings} | {probe['seed']} | {probe['steps']} | "
                         f"{len(probe['episodes'])} ({', '.join(map(str, probe['episodes'][:8]))}) | "
                         f"{probe['accuracy']:.2f} |")
    return lines


def evaluate(root: str) -> str:
    """The tables of every finished run under ``root``, written to ``benchmarks/results/natural_spikes.md``."""
    folders = run_folders(root)
    rows = [row for folder in folders for row in evaluate_run(folder)]
    runs: Dict[str, List[Tuple[int, int]]] = {}
    for folder in folders:
        mechanism, _, seed = os.path.basename(folder).rpartition("-")
        with open(os.path.join(folder, "record.json"), encoding="utf-8") as handle:
            runs.setdefault(mechanism, []).append((int(seed), len(json.load(handle)["loss"])))
    lines = ["# Natural spikes: the report's answer against an independent ground truth", "",
             f"Generated by `python3 benchmarks/natural_spikes.py evaluate {root}` from the runs' saved logs (not in "
             "git); the rule and the set-up are in the module's docstring. A fire agrees where the report names the "
             f"truth's signal, one of its buckets, at a step within {STEP_TOLERANCE} of the truth's. Lead: the loss "
             "spike's step minus the first step any bucket's gradient left its level.", "",
             *summary_table(rows, runs), "", "## Every fire", "", *fire_table(rows), "", "## The mechanisms", "",
             *mechanism_table(), "", "## The rule's noise", "",
             f"Each signal's norm over its level at quiet steps (from step {QUIET_FROM}, not from "
             f"{QUIET_MARGIN[0]} steps before a loss jump to {QUIET_MARGIN[1]} after), every bucket of every run:",
             "", *noise_table(folders)]
    probes = probe_table(os.path.join(root, "probes.jsonl"))
    if probes:
        lines += ["", "## Probes (plain PyTorch, one process, 1 thread)", "", *probes]
    text = "\n".join(lines) + "\n"
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "natural_spikes.md"), "w", encoding="utf-8") as out:
        out.write(text)
    return text


# ---------------------------------------------------------------- running


def run(mechanisms: Sequence[str], seeds: Sequence[int], steps: Optional[int], out: str) -> None:
    """Every mechanism at every seed, in one launch on ``WORLD_SIZE`` CPU ranks."""
    from megatron_integration.cpu_launch import launch

    specs = [RunSpec(MECHANISMS[name], seed, os.path.join(out, f"{name}-{seed}"), steps=steps)
             for name in mechanisms for seed in seeds]
    records = launch(train_all, WORLD_SIZE, specs, timeout=24 * 3600)[0]
    for record in records:
        print(record.get("error") or f"{record['spec']['outdir']}: {len(record['loss'])} steps, fires "
              f"{record['fires']}, {record['seconds']:.0f} s", file=sys.stderr)


def probe(name: str, seeds: Sequence[int], steps: Optional[int], settings: Dict[str, Any], out: str) -> None:
    """``train_plain`` of the mechanism with ``settings`` replaced, each seed's loss-jump episodes appended to
    ``out/probes.jsonl``."""
    import time

    import torch

    torch.set_num_threads(1)
    mechanism = replace(MECHANISMS[name], **settings)
    os.makedirs(out, exist_ok=True)
    for seed in seeds:
        started = time.time()
        record = train_plain(mechanism, seed, steps)
        found = {"mechanism": name, "settings": settings, "seed": seed, "steps": len(record["loss"]),
                 "episodes": episodes(loss_jumps(record["loss"])), "accuracy": record["accuracy"][-1][1],
                 "seconds": round(time.time() - started)}
        print(json.dumps(found), file=sys.stderr)
        with open(os.path.join(out, "probes.jsonl"), "a", encoding="utf-8") as handle:
            handle.write(json.dumps(found) + "\n")


def _setting(text: str) -> Tuple[str, Any]:
    key, _, value = text.partition("=")
    return key, tuple(json.loads(value)) if value.startswith("[") else json.loads(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for command in ("run", "probe"):
        sub = commands.add_parser(command)
        if command == "run":
            sub.add_argument("--mechanisms", nargs="+", default=["slingshot"], choices=list(MECHANISMS))
        else:
            sub.add_argument("mechanism", choices=list(MECHANISMS))
            sub.add_argument("--set", nargs="*", type=_setting, default=[], metavar="KEY=VALUE",
                             help="a Mechanism field replaced, its value JSON: lr=3e-3 betas=[0.9,0.9999]")
        sub.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4] if command == "run" else [0])
        sub.add_argument("--steps", type=int, default=None, help="default: the mechanism's")
        sub.add_argument("--out", default=DEFAULT_OUT)
    sub = commands.add_parser("evaluate")
    sub.add_argument("root", nargs="?", default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.command == "run":
        run(args.mechanisms, args.seeds, args.steps, args.out)
    elif args.command == "probe":
        probe(args.mechanism, args.seeds, args.steps, dict(args.set), args.out)
    else:
        print(evaluate(args.root))


if __name__ == "__main__":
    main()
