"""Step-time overhead of per-layer statistics and of what a user has today, in one run per model.

Each method is timed on alternate iterations of the same engine (tagged vs untagged neighbours), so
that every figure is a ratio measured within one run:

- per-layer statistics: ``layer_grad_norms`` with ``interval: 2`` (every other step measured);
- a ``deepspeed.utils.safe_get_full_grad`` loop over all parameters (norm, min, max of each);
- module backward hooks (``register_full_backward_hook`` on each transformer layer: norm, min, max of
  ``grad_output``), the prototype approach: ACTIVATION gradients, not parameter gradients;
- a per-parameter ``.norm()`` (and min, max) loop after backward: over ``param.grad`` without ZeRO; under
  ZeRO-1/2 ``param.grad`` is None after backward, so over ZeRO's local gradient pieces instead.

The baselines run with the statistics switched off (``engine.set_layer_grad_norms(enabled=False)``).

Beside the step-time ratio, whose noise on a shared machine is wider than 1%, the time spent inside
the call sites themselves (every adapter method that DeepSpeed calls, ``hooks.CALL_SITES``) is
added up per iteration: the feature's own cost, measured directly, as a share of the step.
"""

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from common import CollectiveCounter, machine, paired_ratios, percent, spread

from megatron_integration.tiny_gpt import TinyGPT, TinyGPTConfig, synthetic_batch

METHODS = ("layer_stats", "full_grad_loop", "backward_hooks", "param_norm_loop")


@dataclass
class Spec:
    num_layers: int
    hidden: int
    zero_stage: int
    steps: int
    micro_batch: int = 4
    threads: int = 0
    """torch threads per rank (0: torch's default)"""


def model_config(spec: Spec) -> TinyGPTConfig:
    return TinyGPTConfig(vocab_size=1024, seq_len=64, hidden=spec.hidden, num_layers=spec.num_layers, num_heads=8)


def full_grad_loop(engine) -> None:
    """What a user can do today: gather every full gradient, then per-parameter norm, min and max."""
    from deepspeed.utils import safe_get_full_grad

    for param in engine.module.parameters():
        grad = safe_get_full_grad(param)
        torch.stack([grad.norm(), grad.min(), grad.max()]).tolist()


def param_norm_loop(engine) -> None:
    """Norm, min and max of each parameter's gradient after backward, one host sync at the end.

    Without ZeRO these are the ``.grad`` tensors; under ZeRO-1/2 ``.grad`` is None by then, and the
    closest thing is the optimizer's per-parameter pieces of this rank's gradient partition
    (``averaged_gradients``, DeepSpeed internals; this rank's part only, not combined across ranks).
    """
    if engine.zero_optimization_stage() == 0:
        grads = [param.grad for param in engine.module.parameters() if param.grad is not None]
    else:
        grads = [grad for group in engine.optimizer.averaged_gradients.values() for grad in group]
    torch.stack([torch.stack([grad.norm(), grad.min(), grad.max()]) for grad in grads]).tolist()


def time_call_sites(before: Callable[[], None] = lambda: None) -> List[float]:
    """Wrap every adapter method that DeepSpeed calls, to add up the seconds spent in them into the
    returned one-element list. None of them calls another, so none counts twice. ``before`` runs ahead
    of each, untimed (on an accelerator: wait for the work queued before the call)."""
    from deepspeed_patch.adapters.attach import OPTIMIZER_FAMILIES
    from deepspeed_patch.adapters.base import LayerGradNormsAdapter
    from deepspeed_patch.adapters.param_grads import ParamGradAdapter
    from deepspeed_patch.hooks import CALL_SITES, AdapterCall

    spent = [0.0]

    def timed(original: Callable) -> Callable:

        def wrapper(*args, **kwargs):
            before()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        return wrapper

    names = {site.statement.name for site in CALL_SITES if isinstance(site.statement, AdapterCall)}
    for cls in (LayerGradNormsAdapter, ParamGradAdapter, *OPTIMIZER_FAMILIES):
        for name in names & set(vars(cls)):
            setattr(cls, name, timed(vars(cls)[name]))
    return spent


def tiny_engine(spec: Spec, block: dict):
    """The benchmarks' engine: ``deepspeed_patch.install()``, then a TinyGPT of ``spec`` under its ZeRO stage
    (AdamW, clipping at 1.0) with ``block`` as its ``layer_grad_norms`` block."""
    import deepspeed

    import deepspeed_patch

    deepspeed_patch.install()
    if spec.threads:
        torch.set_num_threads(spec.threads)
    torch.manual_seed(0)
    model = TinyGPT(model_config(spec))
    ds_config = {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": spec.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "layer_grad_norms": block,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      config=ds_config)
    return engine


def iterations(engine, spec: Spec) -> Callable[..., float]:
    """``iteration(step, after_backward=None, hooks=False)``: one forward, backward and optimizer step of
    ``engine`` between barriers, its wall time; ``after_backward(engine)`` runs before the optimizer step,
    ``hooks`` puts a backward hook on each transformer layer (norm, min, max of its output gradient)."""
    from deepspeed import comm as dist

    config = model_config(spec)
    rank = dist.get_rank()
    activation_stats: List[torch.Tensor] = []

    def hook(module, grad_input, grad_output) -> None:
        grad = grad_output[0]
        activation_stats.append(torch.stack([grad.norm(), grad.min(), grad.max()]))

    def iteration(step: int, after_backward: Optional[Callable] = None, hooks: bool = False) -> float:
        batch = synthetic_batch(config, spec.micro_batch, seed=step * 7 + rank)
        dist.barrier()
        start = time.perf_counter()
        handles = [layer.register_full_backward_hook(hook) for layer in engine.module.layers] if hooks else []
        engine.backward(engine(batch))
        if hooks:
            for handle in handles:
                handle.remove()
            torch.stack(activation_stats).tolist()
            activation_stats.clear()
        if after_backward is not None:
            after_backward(engine)
        engine.step()
        dist.barrier()
        return time.perf_counter() - start

    return iteration


def layer_stats_timings(engine, iteration: Callable[..., float], steps: int, inside: List[float]) -> Dict[str, list]:
    """Four warm-up iterations, then ``steps`` with the per-layer statistics on (``interval: 2``), each tagged
    with whether it was measured: the wall time (``"layer_stats"``), the seconds inside the call sites
    (``"inside"``) and the calls into ``deepspeed.comm`` by name (``"collectives"``, the barriers around
    each iteration included)."""
    counter = CollectiveCounter()
    timings: Dict[str, list] = {"layer_stats": [], "inside": [], "collectives": []}
    for step in range(4):  # warm-up; leaves the optimizer step count even
        iteration(step)
    for step in range(steps):
        inside_before = inside[0]
        counter.take()
        seconds = iteration(step)
        calls = counter.take()
        result = engine.get_layer_grad_norms()
        measured = result is not None and result["step"] == engine.global_steps
        timings["layer_stats"].append((measured, seconds))
        timings["inside"].append((measured, inside[0] - inside_before))
        timings["collectives"].append((measured, calls))
    return timings


def layer_stats_rank(spec: Spec) -> Dict[str, list]:
    """The per-layer statistics alone (``layer_stats_timings``), for comparing two versions of the package."""
    inside = time_call_sites()
    engine = tiny_engine(spec, {"enabled": True, "interval": 2})
    timings = layer_stats_timings(engine, iterations(engine, spec), spec.steps, inside)
    engine.destroy()
    return timings


def bench_rank(spec: Spec) -> Dict[str, list]:
    """Per-iteration wall time, tagged with whether the method ran, for every method; and, for the
    per-layer statistics, the seconds spent inside the call sites (``"inside"``) and the collectives."""
    inside = time_call_sites()
    engine = tiny_engine(spec, {"enabled": True, "interval": 2})
    iteration = iterations(engine, spec)
    timings = layer_stats_timings(engine, iteration, spec.steps, inside)
    engine.set_layer_grad_norms(enabled=False)
    others = {"full_grad_loop": {"after_backward": full_grad_loop}, "backward_hooks": {"hooks": True},
              "param_norm_loop": {"after_backward": param_norm_loop}}
    for method, options in others.items():
        timings[method] = [(step % 2 == 1, iteration(step, **(options if step % 2 == 1 else {})))
                           for step in range(spec.steps)]
    engine.destroy()
    return timings


def _share(shares: Dict[str, float]) -> str:
    """A share of the step as a percentage: ``0.81% (0.74-0.90)``."""
    return f"{shares['median'] * 100:.2f}% ({shares['q1'] * 100:.2f}-{shares['q3'] * 100:.2f})"


def specs(quick: bool) -> List[Spec]:
    """One thread per rank: 2 ranks on 2 cores. With torch's default of 2 threads per rank the 4 threads
    contend for 2 cores and steps take 2-10 times longer at random (ratios with IQRs of 100 points)."""
    if quick:
        return [Spec(12, 256, stage, 10, threads=1) for stage in (1, 2)]
    return ([Spec(12, 256, stage, 30, threads=1) for stage in (0, 1, 2)]
            + [Spec(24, 512, stage, 12, threads=1) for stage in (1, 2)])


def run(quick: bool) -> Tuple[List[str], dict]:
    from megatron_integration.cpu_launch import launch

    data = {"machine": machine(), "rows": []}
    lines = [
        "# Cost of per-layer gradient statistics: step time", "", f"Machine: {data['machine']}.", "",
        "2 CPU ranks (gloo) of one torch thread each, AdamW, gradient clipping 1.0, micro-batch 4 of 64 tokens. "
        "Each method runs on every "
        "other iteration of the same engine; each figure is the median (interquartile range, count) of the ratio "
        "of an iteration with the method to the mean of its two neighbours without it, all in one run. The "
        "baselines run with the per-layer statistics switched off.", "",
        "| model | ZeRO | params | step time | per-layer stats (all layers, pre+post clip) "
        "| time inside the call sites, measured / unmeasured step "
        "| `safe_get_full_grad` loop | module backward hooks (activation gradients!) | per-parameter `.norm()` loop |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    ]
    for spec in specs(quick):
        timings = launch(bench_rank, 2, spec, timeout=1200)[0]
        baseline = [seconds for measured, seconds in timings["layer_stats"] if not measured]
        params = sum(p.numel() for p in TinyGPT(model_config(spec)).parameters())
        ratios = {method: spread(paired_ratios(timings[method])) for method in METHODS}
        inside = {
            state: spread([seconds / spread(baseline)["median"] for measured, seconds in timings["inside"]
                           if measured == state]) for state in (True, False)
        }
        data["rows"].append({"layers": spec.num_layers, "hidden": spec.hidden, "zero": spec.zero_stage,
                             "params": params, "step_seconds": spread(baseline)["median"], "ratios": ratios,
                             "inside_measured": inside[True], "inside_unmeasured": inside[False]})
        loop = percent(ratios["param_norm_loop"]) + ("" if spec.zero_stage == 0 else " †")
        zero = f"{spec.zero_stage}" if spec.zero_stage else "0 (no ZeRO, fp32)"
        row = (f"| {spec.num_layers} layers, hidden {spec.hidden} | {zero} | {params / 1e6:.1f}M "
               f"| {spread(baseline)['median'] * 1000:.0f} ms | {percent(ratios['layer_stats'])} "
               f"| {_share(inside[True])} / {_share(inside[False])} "
               f"| {percent(ratios['full_grad_loop'])} | {percent(ratios['backward_hooks'])} | {loop} |")
        print(row, flush=True)
        lines.append(row)
    medians = [(row["ratios"]["layer_stats"]["median"] - 1) * 100 for row in data["rows"]]
    inside = [row["inside_measured"]["median"] * 100 for row in data["rows"]]
    widths = [(row["ratios"]["layer_stats"]["q3"] - row["ratios"]["layer_stats"]["q1"]) * 100 for row in data["rows"]]
    lines += [
        "", f"Target (issue 6): at most +1% median step time for the per-layer statistics. Medians here: "
        f"{', '.join(f'{median:+.1f}%' for median in medians)}, with interquartile ranges {min(widths):.0f} to "
        f"{max(widths):.0f} points wide: on this 2-core machine, shared with other jobs, one run does not resolve "
        "1% by the ratio. Measured directly, the time spent inside the call sites is "
        f"{', '.join(f'{share:.2f}%' for share in inside)} of the step on measured steps (medians, same order), "
        "and nothing measurable on the others.",
        "", "What each column measures:", "",
        "- time inside the call sites: the seconds spent in the functions DeepSpeed calls (layer map look-ups, "
        "the statistics, the one all-gather, building the result), per iteration, as a share of the median "
        "unmeasured step: median (IQR). The all-gather's wait for the other rank counts too, so this is an "
        "upper bound of the feature's own time, free of the step-to-step noise of the ratio beside it.",
        "- per-layer stats: norm, min, max, abs-min of each layer's PARAMETER gradient, before and after "
        "clipping, combined across ranks with one collective (`layer_grad_norms`, `interval: 2`).",
        "- `safe_get_full_grad` loop: DeepSpeed's public API; one all-reduce per parameter to rebuild each full "
        "gradient, then its norm, min and max.",
        "- module backward hooks: `register_full_backward_hook` on each transformer layer, norm, min and max of "
        "`grad_output`: the gradient of the layer's OUTPUT ACTIVATION, not of its parameters (the prototype "
        "approach); per rank, not combined across ranks.",
        "- per-parameter `.norm()` loop: norm, min and max of each parameter's gradient after backward. "
        "ZeRO 0 (DeepSpeed without ZeRO, fp32): `param.grad`, complete on every rank.",
        "- † ZeRO-1 and ZeRO-2: not applicable as such: `param.grad` is None after backward in both stages "
        "(DeepSpeed 0.19.8 moves each gradient into its reduce buckets and frees it). The figure is the same "
        "loop over ZeRO's per-parameter pieces of this rank's partition (`optimizer.averaged_gradients`, "
        "DeepSpeed internals): local parts only, not combined across ranks, so not a per-parameter norm of the "
        "model; a lower bound on what such a loop costs.",
    ]
    return lines, data

