"""The remedies judged on the spikes they are for: natural spikes, a gradient outlier and issue 38's injected faults.

    python benchmarks/remedies_natural.py [--mechanisms slingshot outlier faults] [--seeds 0 1 2 3 4]
                                          [--arms ...] [--steps N] [--outlier grad:STEP:FACTOR] ...
    python benchmarks/remedies_natural.py --summarize   # the table again from the runs already made

Every run is one of issue 44's natural-spike mechanisms (``spike_mechanisms``: modular addition in a small Pre-LN
transformer, DeepSpeed ZeRO-2 on one CPU rank), at a seed, under one remedy arm (``ARMS``):

- ``none``: no clipping (the mechanism's own recipe); ``global_1``: DeepSpeed's ``gradient_clipping: 1.0``;
  ``global_tuned``: ``gradient_clipping`` at the median global gradient norm of the same seed's ``none`` run;
- ``adaptive_layer`` and ``adaptive_param``: ``adaptive_clipping`` at its defaults, one bucket per layer and one per
  parameter (``granularity: "param"``, AdaGC's own per-tensor rule); ``skip``: ``skip_step`` at its defaults;
  ``both``: ``adaptive_layer`` and ``skip``;
- ``zclip``: ZClip (the ``zclip`` package, Kumar et al. 2025) at its defaults, acting on the engine's gradient
  through ``EngineZClip``.

The mechanisms (``MECHANISMS``): ``slingshot`` as it is (natural spikes); ``outlier``: the same recipe with one
batch's gradient multiplied by a factor at one step (its backward scaled: AdaGC's design case); ``faults``: the same
recipe with issue 38's two injected faults (``spike_prone.py``): a burst of corrupted batches (random tokens: their
labels no longer follow from them) and the learning rate x20 for one step.

Measured per run (``run_metrics``): large loss spikes (``large_spikes``), the steps until the held-out accuracy
reaches 0.99, the final loss, the steps the remedies acted on, and the median step time over the ``none`` arm's of
the same seed. The runs' records go to ``runs/remedies_natural/`` (gitignored); the table to
``benchmarks/results/remedies_natural.md``.

The committed table came from (seed 0; seed 1 for ``none`` and ``adaptive_layer``; docs/remedies.md says why):

    remedies_natural.py --skip-done --mechanisms slingshot --seeds 0 --steps 1500 \
        --arms none global_1 global_tuned adaptive_layer adaptive_param skip zclip
    remedies_natural.py --skip-done --mechanisms outlier --seeds 0 --steps 350 \
        --arms none global_tuned adaptive_layer adaptive_param skip zclip
    remedies_natural.py --skip-done --mechanisms faults --seeds 0 --steps 350 --arms none adaptive_layer skip
    remedies_natural.py --skip-done --mechanisms slingshot --seeds 1 --steps 1500 --arms none adaptive_layer
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch
from common import machine, write_results
from spike_mechanisms import MECHANISMS as NATURAL
from spike_mechanisms import RunSpec, StepHooks, train
from spike_prone import Fault
from zclip import ZClip

RUNS = os.environ.get("REMEDIES_NATURAL_RUNS", os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs", "remedies_natural"))
"""Where the runs go (gitignored): ``REMEDIES_NATURAL_RUNS`` or the checkout's ``runs/remedies_natural``."""
SPIKE_FACTOR = 10.0
SPIKE_MARGIN = 0.5
SPIKE_WINDOW = 50
"""A large loss spike: a loss above ``SPIKE_FACTOR`` times, or ``SPIKE_MARGIN`` above, the median of the previous
``SPIKE_WINDOW`` losses (issue 45's rule)."""
TARGET_ACCURACY = 0.99
FINAL_SPAN = 10
"""The final loss: the mean training loss of the last ``FINAL_SPAN`` steps."""
BASELINE = "none"
ADAPTIVE = {"enabled": True, "beta": 0.98, "factor": 1.05, "warmup_steps": 100}
SKIP = {"enabled": True, "sigma": 6.0, "window": 128}
ARMS: Dict[str, Dict[str, Any]] = {
    "none": {},
    "global_1": {"clip": 1.0},
    "global_tuned": {"clip": "tuned"},
    "adaptive_layer": {"block": {"adaptive_clipping": ADAPTIVE}},
    "adaptive_param": {"block": {"adaptive_clipping": ADAPTIVE, "granularity": "param"}},
    "skip": {"block": {"skip_step": SKIP}},
    "both": {"block": {"adaptive_clipping": ADAPTIVE, "skip_step": SKIP}},
    "zclip": {"zclip": {}},
}
"""Each arm: ``clip`` DeepSpeed's ``gradient_clipping`` (``"tuned"``: ``tuned_threshold``), ``block`` the remedy keys
of the ``layer_grad_norms`` block, ``zclip`` ZClip's keyword arguments (its defaults)."""
QUIET_BLOCK = {"optimizer_statistics": []}
SILENT_TRIGGER = {"grad_norm_factor": None, "loss_factor": None, "on_overflow": False}
"""The feature's block in a remedy arm holds the remedy alone: no optimizer statistics (refused with a remedy) and a
trigger that watches nothing."""


class Injection(Fault):
    """A fault of ``spike_prone.py`` (``data:STEP:LEN``, ``lr:STEP:FACTOR``) or a gradient outlier,
    ``grad:STEP:FACTOR``: every gradient of the step's batch times FACTOR (the gradient flowing back from the loss
    is scaled; the loss itself, the one reported and logged, is not)."""

    KINDS = ("data", "lr", "grad")


@dataclass
class Mechanism:
    """A natural mechanism of ``spike_mechanisms`` and the faults injected into it."""

    natural: str
    faults: List[str] = field(default_factory=list)


MECHANISMS = {
    "slingshot": Mechanism("slingshot"),
    "outlier": Mechanism("slingshot", ["grad:200:100"]),
    "faults": Mechanism("slingshot", ["data:200:5", "lr:275:20"]),
}


class EngineZClip(ZClip):
    """ZClip's rule on a DeepSpeed ZeRO-1/2 engine's gradient, where ``ZClip.step(model)`` sees none (ZeRO keeps it
    in its own partitions, not in ``param.grad``).

    ZClip decides from the step's global norm before the step; DeepSpeed has it only inside ``optimizer.step()``,
    in ``unscale_and_clip_grads(grads, total_norm)``, just before it clips the partitions to ``clip_grad``. So this
    wraps that method of the engine's optimizer: it feeds the engine's norm to ZClip's own ``step`` (its warm-up,
    z-score, EMA updates unchanged) and sets ``clip_grad`` to the limit ZClip would have clipped to, or 0 (no
    clipping) where ZClip would not have scaled. DeepSpeed then scales by ``limit / (norm + 1e-6)``, ZClip's own
    coefficient. ``limits`` holds each step's limit (0: not clipped)."""

    def __init__(self, optimizer, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.limits: List[float] = []
        self._norm = 0.0
        self._limit = 0.0
        unscale_and_clip = optimizer.unscale_and_clip_grads

        def clip_by_zclip(grad_groups_flat, total_norm):
            optimizer.clip_grad = self.limit(float(total_norm) / optimizer.loss_scale)
            return unscale_and_clip(grad_groups_flat, total_norm)

        optimizer.unscale_and_clip_grads = clip_by_zclip

    def limit(self, norm: float) -> float:
        """The global-norm limit ZClip sets for a step of global gradient norm ``norm`` (0: none); advances ZClip's
        state as ``ZClip.step`` does."""
        self._norm = norm
        warming_up = not self.initialized
        self._limit = (self.max_grad_norm or 0.0) if warming_up and norm > (self.max_grad_norm or math.inf) else 0.0
        with warnings.catch_warnings():  # its warm-up's clip_grad_norm_ on no parameters: the limit above does it
            warnings.simplefilter("ignore", UserWarning)
            self.step(torch.nn.Module())
        self.limits.append(self._limit)
        return self._limit

    def _compute_grad_norm(self, model) -> float:
        return self._norm

    def apply_in_place_clipping(self, pl_module, global_norm: float, max_global_norm: float) -> None:
        self._limit = max_global_norm if global_norm > max_global_norm else 0.0


class ArmHooks(StepHooks):
    """A run's per-step actions: the injected faults, ZClip's installation, and the time of each step (from the end
    of one step to the end of the next, those with a held-out evaluation left out)."""

    def __init__(self, faults: Sequence[Fault], zclip: Optional[Dict[str, Any]], eval_every: int) -> None:
        self.faults, self.zclip_args, self.eval_every = list(faults), zclip, eval_every
        self.zclip: Optional[EngineZClip] = None
        self.corrupted = {step for fault in self.faults if fault.kind == "data" for step in fault.steps()}
        self.seconds: List[float] = []
        self._next_step = 2
        self._last: Optional[float] = None
        self._saved_lrs: List[float] = []
        self._noise = torch.Generator().manual_seed(4242)
        self._installed = False

    def before_backward(self, step: int, engine, loss: torch.Tensor) -> torch.Tensor:
        if not self._installed:
            self._install(engine)
        for fault in self.faults:
            if fault.step == step and fault.kind == "grad":
                loss.register_hook(lambda grad, factor=fault.size: grad * factor)
            if fault.step == step and fault.kind == "lr":
                groups = engine.optimizer.param_groups
                self._saved_lrs = [group["lr"] for group in groups]
                for group in groups:
                    group["lr"] *= fault.size
        return loss

    def _install(self, engine) -> None:
        """At the first step: ZClip on the engine's optimizer, and the corruption of the data faults' batches."""
        if self.zclip_args is not None:
            self.zclip = EngineZClip(engine.optimizer, **self.zclip_args)
        if self.corrupted:
            engine.module.register_forward_pre_hook(self._random_tokens)
        self._installed = True

    def _random_tokens(self, module, args):
        """A data fault's training batch (never the held-out evaluation, run without gradients): random tokens."""
        if self._next_step not in self.corrupted or not torch.is_grad_enabled():
            return None
        tokens, *rest = args
        return (torch.randint_like(tokens, 0, int(tokens.max()) + 1, generator=self._noise), *rest)

    def after_step(self, step: int, engine) -> None:
        for group, lr in zip(engine.optimizer.param_groups, self._saved_lrs):
            group["lr"] = lr
        self._saved_lrs = []
        self._next_step = step + 1
        now = time.perf_counter()
        if self._last is not None:
            self.seconds.append(now - self._last)
        self._last = None if step % self.eval_every == 0 else now


# ---------------------------------------------------------------- runs (inside the launched rank)


@dataclass
class Plan:
    """What every run shares besides its mechanism, arm and seed."""

    steps: int = 3000
    eval_every: int = 50
    outdir: str = RUNS
    injected: Dict[str, List[str]] = field(default_factory=lambda: {name: list(m.faults)
                                                                     for name, m in MECHANISMS.items()})
    """Each mechanism's faults (``Injection.parse`` texts): ``MECHANISMS``' unless the command line says."""


@dataclass
class Job:
    mechanism: str
    arm: str
    seed: int


def tuned_threshold(plan: Plan, mechanism: str, seed: int) -> float:
    """``global_tuned``'s ``gradient_clipping``: the median global gradient norm of the seed's ``none`` run of the
    natural mechanism, without injections (one threshold for a seed, whatever is injected: made before it, as
    ``jobs`` puts ``none`` first and the natural mechanism's runs come first on the command line)."""
    record = read_run(plan, Job(MECHANISMS[mechanism].natural, BASELINE, seed))
    return statistics.median(norm for norm in record["grad_norm"] if math.isfinite(norm))


def run_spec(plan: Plan, job: Job) -> RunSpec:
    """The ``spike_mechanisms`` run of a job: the arm's ``gradient_clipping`` and remedy keys; the feature's block
    only where a remedy needs it (its statistics alone are bit-identical, and cost time)."""
    arm = ARMS[job.arm]
    clip = arm.get("clip", 0.0)
    if clip == "tuned":
        clip = tuned_threshold(plan, job.mechanism, job.seed)
    block = arm.get("block")
    return RunSpec(NATURAL[MECHANISMS[job.mechanism].natural], job.seed, run_dir(plan, job), steps=plan.steps,
                   truth=False, feature=block is not None, eval_every=plan.eval_every, trigger=SILENT_TRIGGER,
                   block_extra={**QUIET_BLOCK, **(block or {})}, config_extra={"gradient_clipping": clip})


def run_dir(plan: Plan, job: Job) -> str:
    return os.path.join(plan.outdir, job.mechanism, f"{job.arm}_s{job.seed}")


def read_run(plan: Plan, job: Job) -> Dict[str, Any]:
    with open(os.path.join(run_dir(plan, job), "run.json"), encoding="utf-8") as handle:
        return json.load(handle)


def train_jobs(plan: Plan, jobs: List[Job]) -> int:
    """Every job in order, in this one process; each run's record (``spike_mechanisms.train``'s, with the step
    times, ZClip's limits and the clipping threshold) written to its folder as ``run.json`` as it ends. Returns the
    number of runs."""
    import logging

    import deepspeed_patch

    deepspeed_patch.install()
    torch.set_num_threads(1)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    for number, job in enumerate(jobs, 1):
        started = time.time()
        faults = [Injection.parse(text) for text in plan.injected[job.mechanism]]
        spec = run_spec(plan, job)
        hooks = ArmHooks(faults, ARMS[job.arm].get("zclip"), plan.eval_every)
        record = train(spec, hooks)
        record.update(job=asdict(job), faults=[asdict(fault) for fault in faults], step_seconds=hooks.seconds,
                      gradient_clipping=spec.config_extra["gradient_clipping"],
                      zclip_limits=hooks.zclip.limits if hooks.zclip else None)
        with open(os.path.join(spec.outdir, "run.json"), "w", encoding="utf-8") as out:
            json.dump(record, out)
        metrics = run_metrics(record)
        print(f"[remedies_natural] {number}/{len(jobs)} {job.mechanism} {job.arm} seed {job.seed}: "
              f"{time.time() - started:.0f} s, {metrics['spikes']} large spikes, "
              f"final loss {metrics['final_loss']:.3g}, "
              f"accuracy 0.99 at {metrics['steps_to_target']}", file=sys.stderr, flush=True)
    return len(jobs)


# ---------------------------------------------------------------- metrics


def large_spikes(losses: Sequence[float]) -> List[int]:
    """The steps (1-based) where a large loss spike starts: a loss above ``SPIKE_FACTOR`` times, or
    ``SPIKE_MARGIN`` above, the median of the previous ``SPIKE_WINDOW`` losses; consecutive such steps are one
    spike. A non-finite loss is a spike."""
    starts, inside = [], False
    for index in range(SPIKE_WINDOW, len(losses)):
        median = statistics.median(losses[index - SPIKE_WINDOW:index])
        loss = losses[index]
        spiking = not math.isfinite(loss) or loss > SPIKE_FACTOR * median or loss > median + SPIKE_MARGIN
        if spiking and not inside:
            starts.append(index + 1)
        inside = spiking
    return starts


def steps_to_target(accuracy: Sequence[Sequence[float]]) -> Optional[int]:
    """The first evaluated step whose held-out accuracy is at least ``TARGET_ACCURACY`` (``None``: never)."""
    return next((int(step) for step, value in accuracy if value >= TARGET_ACCURACY), None)


def run_metrics(record: Dict[str, Any]) -> Dict[str, Any]:
    """One run's measures: its large spikes, the steps until the target accuracy, the final loss and accuracy,
    the steps each remedy acted on, the median step time."""
    losses = record["loss"]
    zclip = record.get("zclip_limits") or []
    return {
        "spikes": len(large_spikes(losses)),
        "spike_steps": large_spikes(losses),
        "steps_to_target": steps_to_target(record["accuracy"]),
        "final_loss": statistics.fmean(losses[-FINAL_SPAN:]),
        "final_accuracy": record["accuracy"][-1][1],
        "max_grad_norm": max(norm for norm in record["grad_norm"] if math.isfinite(norm)),
        "median_grad_norm": statistics.median(norm for norm in record["grad_norm"] if math.isfinite(norm)),
        "skipped": sum(record["skipped"]),
        "zclip_clipped": sum(limit > 0 for limit in zclip) if zclip else None,
        "step_seconds": statistics.median(record["step_seconds"]),
    }



def adaptive_activity(path: str) -> Dict[str, Any]:
    """From a run's JSONL dump: the steps on which adaptive clipping scaled some bucket down, and the median over
    those steps of the smallest factor."""
    smallest = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                factors = [f for f in (json.loads(line).get("adaptive_clip") or {}).values() if f is not None]
                if factors and min(factors) < 1.0:
                    smallest.append(min(factors))
    return {"clipped_steps": len(smallest),
            "median_smallest_factor": statistics.median(smallest) if smallest else None}


# ---------------------------------------------------------------- the table


def cell(values: Sequence[Optional[float]], digits: str = ".3g") -> str:
    """Median and range of ``values`` (``None``: never reached, shown as such and counted as the largest)."""
    reached = [value for value in values if value is not None]
    if not values:
        return "-"
    if not reached:
        return "never"
    digits = "g" if digits == "d" else digits  # a median of two counts may be a half
    shown = f"{statistics.median(reached):{digits}}"
    if len(values) > 1:
        shown += f" ({min(reached):{digits}}-{max(reached):{digits}})"
    missing = len(values) - len(reached)
    return shown + (f", never in {missing}" if missing else "")


def summary(runs: List[Dict[str, Any]]) -> List[str]:
    """One table per mechanism: each arm's measures, median (range) over its seeds."""
    lines = []
    for mechanism in [name for name in MECHANISMS if any(run["job"]["mechanism"] == name for run in runs)]:
        mine = [run for run in runs if run["job"]["mechanism"] == mechanism]
        faults = ", ".join(f"{fault['kind']}:{fault['step']}:{fault['size']:g}" for fault in mine[0]["faults"])
        lines += ["", f"## {mechanism}" + (f" (injected: {faults})" if faults else ""), "",
                  "| arm | seeds | large spikes | steps to 0.99 held-out accuracy | final loss | final accuracy | "
                  "acted on (steps) | loss after injection / without | step time / none |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for arm in [name for name in ARMS if any(run["job"]["arm"] == name for run in mine)]:
            lines.append(arm_row(arm, [run for run in mine if run["job"]["arm"] == arm], mine))
        lines += ["", "Per run: where the large spikes started; the global gradient norm (median, largest); "
                  "the arm's clipping threshold; adaptive clipping's median smallest factor on the steps it clipped.",
                  ""]
        lines += [run_line(run) for run in mine]
    return lines


def injected_cost(run: Dict[str, Any], clean: Optional[Dict[str, Any]]) -> Optional[float]:
    """What the injections cost a run: its mean training loss from the first injected step to its end, over that of
    the same arm and seed without them (``clean``: the natural mechanism's run, the same batches); ``None`` without
    injections or without that run."""
    if not run["faults"] or clean is None or len(clean["loss"]) < len(run["loss"]):
        return None
    first = min(fault["step"] for fault in run["faults"]) - 1
    end = len(run["loss"])
    return statistics.fmean(run["loss"][first:end]) / statistics.fmean(clean["loss"][first:end])


def run_line(run: Dict[str, Any]) -> str:
    metrics, job = run["metrics"], run["job"]
    extra = f", gradient_clipping {run['gradient_clipping']:.3g}" if run["gradient_clipping"] else ""
    if metrics.get("smallest_factor") is not None:
        extra += f", smallest factor {metrics['smallest_factor']:.2f}"
    if metrics.get("injected_cost") is not None:
        extra += f", loss after the first injection {metrics['injected_cost']:.2f}x the run without injections"
    spikes = metrics["spike_steps"] or "none"
    return (f"- {job['arm']}, seed {job['seed']}, {len(run['loss'])} steps: spikes at {spikes}; "
            f"norm {metrics['median_grad_norm']:.3g} / {metrics['max_grad_norm']:.3g}{extra}; "
            f"{run['seconds']:.0f} s")


def arm_row(arm: str, runs: List[Dict[str, Any]], mechanism_runs: List[Dict[str, Any]]) -> str:
    metrics = [run["metrics"] for run in runs]
    acted = [m.get("acted") for m in metrics]
    costs = [m.get("injected_cost") for m in metrics]
    spikes = [m["spikes"] for m in metrics]
    return (f"| {arm} | {len(runs)} | {cell(spikes, 'd')} (total {sum(spikes)}) | "
            f"{cell([m['steps_to_target'] for m in metrics], 'd')} | {cell([m['final_loss'] for m in metrics])} | "
            f"{cell([m['final_accuracy'] for m in metrics], '.3f')} | "
            f"{cell(acted, 'd') if any(a is not None for a in acted) else '-'} | "
            f"{cell(costs, '.2f') if any(c is not None for c in costs) else '-'} | "
            f"{step_time_ratio(runs, mechanism_runs)} |")


def step_time_ratio(runs: List[Dict[str, Any]], mechanism_runs: List[Dict[str, Any]]) -> str:
    """The arm's median step time over the ``none`` arm's, from the lowest seed both ran (one run each)."""
    baseline = {run["job"]["seed"]: run for run in mechanism_runs if run["job"]["arm"] == BASELINE}
    paired = sorted((run["job"]["seed"], run) for run in runs if run["job"]["seed"] in baseline)
    if not paired:
        return "-"
    seed, run = paired[0]
    return f"{run['metrics']['step_seconds'] / baseline[seed]['metrics']['step_seconds']:.2f}"


def collect(plan: Plan) -> List[Dict[str, Any]]:
    """Every finished run under ``plan.outdir`` with its measures (``metrics``; ``acted``: the steps skipped,
    clipped by adaptive clipping, or clipped by ZClip)."""
    runs = []
    for mechanism in sorted(os.listdir(plan.outdir)) if os.path.isdir(plan.outdir) else []:
        for name in sorted(os.listdir(os.path.join(plan.outdir, mechanism))):
            path = os.path.join(plan.outdir, mechanism, name, "run.json")
            if not os.path.exists(path):
                continue
            with open(path, encoding="utf-8") as handle:
                run = json.load(handle)
            run["metrics"] = run_metrics(run)
            run["metrics"]["acted"] = acted_steps(run, os.path.join(plan.outdir, mechanism, name, "dump.jsonl"))
            runs.append(run)
    natural = {(run["job"]["arm"], run["job"]["seed"]): run for run in runs
               if not run["faults"] and run["job"]["mechanism"] in NATURAL}
    for run in runs:
        run["metrics"]["injected_cost"] = injected_cost(run, natural.get((run["job"]["arm"], run["job"]["seed"])))
    return runs


def acted_steps(run: Dict[str, Any], dump: str) -> Optional[int]:
    """The steps a remedy acted on: skipped, scaled by adaptive clipping, clipped by ZClip or DeepSpeed's clip."""
    arm, metrics = ARMS[run["job"]["arm"]], run["metrics"]
    if "zclip" in arm:
        return metrics["zclip_clipped"]
    if "clip" in arm:
        return sum(norm > run["gradient_clipping"] for norm in run["grad_norm"])
    block = arm.get("block", {})
    if not block:
        return None
    if "adaptive_clipping" not in block:
        return metrics["skipped"]
    activity = adaptive_activity(dump)
    metrics["smallest_factor"] = activity["median_smallest_factor"]
    return activity["clipped_steps"] + metrics["skipped"]


def jobs(mechanisms: Sequence[str], arms: Sequence[str], seeds: Sequence[int]) -> List[Job]:
    """Seed by seed, ``none`` first (``global_tuned`` reads its norms)."""
    ordered = [BASELINE] + [arm for arm in arms if arm != BASELINE]
    return [Job(mechanism, arm, seed) for mechanism in mechanisms for seed in seeds for arm in ordered]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mechanisms", nargs="+", default=list(MECHANISMS), choices=list(MECHANISMS))
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=Plan.steps)
    parser.add_argument("--eval-every", type=int, default=Plan.eval_every)
    parser.add_argument("--inject", nargs="*", metavar="MECHANISM=KIND:STEP:SIZE",
                        help="replace a mechanism's injected faults (repeat the mechanism for several)")
    parser.add_argument("--skip-done", action="store_true", help="leave out the jobs whose run.json exists")
    parser.add_argument("--summarize", action="store_true", help="only the table, from the runs already made")
    args = parser.parse_args()
    plan = Plan(steps=args.steps, eval_every=args.eval_every)
    replaced: Dict[str, List[str]] = {}
    for text in args.inject or []:
        name, fault = text.split("=")
        replaced.setdefault(name, []).append(fault)
    plan.injected.update(replaced)
    if not args.summarize:
        from megatron_integration.cpu_launch import launch

        todo = [job for job in jobs(args.mechanisms, args.arms, args.seeds)
                if not (args.skip_done and os.path.exists(os.path.join(run_dir(plan, job), "run.json")))]
        launch(train_jobs, 1, plan, todo, timeout=6 * 3600)
    runs = collect(plan)
    lines = [f"# Remedies on natural spikes, a gradient outlier and injected faults ({len(runs)} runs)", "",
             f"`python benchmarks/remedies_natural.py --summarize` ({machine()}). ZeRO-2 on one CPU rank; the arms, "
             "the set-up, what was cut and the reading: [docs/remedies.md](../../docs/remedies.md), \"Measured "
             "result\". Cells: median (range) over seeds. Large spike: a loss above "
             f"{SPIKE_FACTOR:g}x, or {SPIKE_MARGIN:g} above, the median of the previous {SPIKE_WINDOW} steps "
             f"(consecutive steps: one spike). Final loss: the mean of the last {FINAL_SPAN} steps. Acted on: steps "
             "skipped, or clipped (adaptive clipping: some bucket's factor below 1; ZClip, global clipping: the "
             "global norm above the limit). Loss after injection / without: the mean loss from the first injected "
             "step to the end over the same arm's natural run's. Step time / none: median step times of one run "
             "each, under the shared machine's load of the moment (it varied 2-3x): rough."]
    lines += summary(runs)
    write_results("remedies_natural", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
