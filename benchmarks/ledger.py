"""Per-step cost ledger: collectives, host syncs, allocations, operators and time inside the call sites, per mode
and family.

    python benchmarks/ledger.py [--device cpu|cuda] [--ranks N] [--steps N] [--quick] [--out DIR]

Writes ``DIR/ledger.md`` and ``ledger.json`` (``DIR``: benchmarks/results). ``--ranks`` CPU ranks (default 2: a
collective is issued only where there is another rank to combine with), or one CUDA rank; rank 0's counts. For
each optimizer family (ZeRO-1, ZeRO-2, ZeRO-3, BF16_Optimizer, ZeRO-2 with optimizer offload, DeepSpeed without
ZeRO in fp32 and in fp16) and each mode (``MODES``: the feature off, a quiet interval step, a trigger, a trigger
on the loss, a control file's poll, the flight recorder, a measured step, a fire), the functions DeepSpeed calls
(``hooks.CALL_SITES``) are wrapped so that, while one of them runs,

- every call of one of DeepSpeed's collectives (``COLLECTIVES``) is counted;

- every read of a device tensor's value on the host is counted: ``.item()``, ``.tolist()``, ``.cpu()``,
  ``.numpy()``, ``.to()`` the host, ``float()``, ``int()``, ``bool()`` (a host synchronisation on an
  accelerator). On the host, where every tensor is a "device" tensor, a tensor counts as read already once a
  counted ``.cpu()`` (or ``.to()`` the host) made it, as it would be on an accelerator;
- every operator is counted (``TorchDispatchMode``), and so is each one whose output has a storage none of its
  inputs had: an allocation (on CUDA, the caching allocator's own count of allocations is added);
- and, in separate steps without the counters, the seconds inside them are added up.

The Megatron hook (``megatron_integration/training_log.py``) is counted the same way, around its call on each
iteration, with Megatron's loss as a device tensor.

``count_step_costs`` is what ``tests/test_ledger.py`` runs (counts, not times) so that a regression fails CI.
"""

import argparse
import contextlib
import functools
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HOST_READS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")
TRANSFERS = ("cpu", "to")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "broadcast_object_list", "all_to_all_single", "barrier")
"""The functions of ``deepspeed.comm`` whose calls are counted (those this package calls, and their kin)."""

FAMILIES: Dict[str, Dict[str, Any]] = {
    "ZeRO-1": {
        "zero_optimization": {
            "stage": 1
        }
    },
    "ZeRO-2": {
        "zero_optimization": {
            "stage": 2
        }
    },
    "ZeRO-3": {
        "zero_optimization": {
            "stage": 3
        }
    },
    "BF16_Optimizer": {
        "zero_optimization": {
            "stage": 1
        },
        "bf16": {
            "enabled": True
        },
        "data_types": {
            "grad_accum_dtype": "fp32"
        }
    },
    "ZeRO-2 offload": {
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {
                "device": "cpu"
            }
        },
        "zero_force_ds_cpu_optimizer": False
    },
    "stage 0 fp32": {
        "zero_optimization": {
            "stage": 0
        }
    },
    "stage 0 fp16": {
        "zero_optimization": {
            "stage": 0
        },
        "fp16": {
            "enabled": True,
            "initial_scale_power": 8
        }
    },
}
"""Each family's ds_config keys (besides the batch size and clipping)."""

NEVER = 10**9
"""An interval or a trigger factor that is never reached."""
CONTROL_INTERVAL = 1
"""The ``control file`` mode's poll interval: every step polls, so the counted (third) step is a poll that reads
the previous poll's flag and issues its own, as every poll but the first does."""
ABSENT_CONTROL_FILE = os.path.join(tempfile.gettempdir(), "layer_grad_norms_ledger_control_never_written.json")
"""The ``control file`` mode's file, never written: each poll finds nothing new, as on most polls of a real run."""
HISTORY = 4
FIRE_AT = 6
"""The optimizer step whose loss spikes in the ``fire`` mode (after a window of ordinary losses)."""

MODES: Dict[str, Optional[dict]] = {
    "off": None,
    "quiet": {
        "enabled": True,
        "interval": NEVER
    },
    "trigger": {
        "enabled": False,
        "trigger": {
            "grad_norm_factor": NEVER
        }
    },
    "loss trigger": {
        "enabled": False,
        "trigger": {
            "grad_norm_factor": None,
            "loss_factor": NEVER
        }
    },
    "control file": {
        "enabled": False,
        "control_file": ABSENT_CONTROL_FILE,
        "control_interval": CONTROL_INTERVAL
    },
    "recorder": {
        "enabled": False,
        "trigger": {
            "grad_norm_factor": NEVER,
            "history": HISTORY
        }
    },
    "measured": {
        "enabled": True,
        "interval": 1
    },
    "fire": {
        "enabled": False,
        "trigger": {
            "grad_norm_factor": NEVER,
            "loss_factor": 10.0,
            "window": 3,
            "capture_steps": 1,
            "history": HISTORY
        }
    },
}
"""The ``layer_grad_norms`` block of each mode (``None``: none). ``fire`` counts the step whose loss spiked; the
modes with a ``loss_factor`` report a host loss on every step."""

HOOK_MODES: Dict[str, Optional[dict]] = {
    "hook, feature off": None,
    "hook, quiet iteration": {
        "enabled": True,
        "interval": NEVER
    },
    "hook, logged iteration": {
        "enabled": True,
        "interval": 1
    },
    "hook, loss_factor set": {
        "enabled": False,
        "trigger": {
            "grad_norm_factor": NEVER,
            "loss_factor": 10.0
        }
    },
}
"""The Megatron hook's modes, on ZeRO-2: its call after each iteration, with the loss on the device."""


@dataclass
class Costs:
    """What the wrapped calls did during one step."""

    collectives: int = 0
    """Calls of DeepSpeed's collectives (``COLLECTIVES``)."""
    syncs: int = 0
    """Reads of a device tensor's value on the host."""
    ops: int = 0
    """Operators dispatched (on an accelerator: kernel launches, at most)."""
    allocations: int = 0
    """Operators whose output has a storage of its own (on CUDA: or the caching allocator's count, if more)."""
    allocated_bytes: int = 0
    sync_sites: Set[str] = field(default_factory=set)
    """``file:line: method`` of each read."""


class _AllocationCounter(TorchDispatchMode):
    """Counts operators, and those whose outputs have a storage that none of their inputs had. An operator
    whose tensor inputs are all on the host (``host``: their storages) has its outputs there too."""

    def __init__(self, costs: Costs, host: Set[int]) -> None:
        super().__init__()
        self.costs, self.host = costs, host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {_storage(leaf) for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)}
        out = func(*args, **kwargs)
        self.costs.ops += 1
        outputs = {_storage(leaf): leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor)}
        if inputs and inputs <= self.host:
            self.host.update(outputs)
        for key, tensor in outputs.items():
            if key not in inputs and tensor.untyped_storage().nbytes():
                self.costs.allocations += 1
                self.costs.allocated_bytes += tensor.untyped_storage().nbytes()
        return out


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class CallSiteCounter:
    """Wraps every adapter method DeepSpeed calls; counts (``counting``) or times what runs inside them."""

    def __init__(self) -> None:
        self.costs = Costs()
        self.seconds = 0.0
        self.counting = False
        self._depth = 0
        self._reading = 0  # inside a counted read: what it calls is not counted again
        self._host: Set[int] = set()  # storages a counted transfer made: reading them is no sync
        self._patched: List[tuple] = []
        self._patch_tensor_methods()
        self._patch_collectives()
        self._patch_call_sites()

    def close(self) -> None:
        """Put back every method this counter wrapped."""
        for owner, name, original in reversed(self._patched):
            if original is None:  # inherited: remove the wrapper
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._patched.clear()

    def _patch(self, owner, name: str, wrapped: Callable) -> None:
        self._patched.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, wrapped)

    def take(self) -> Costs:
        costs, self.costs = self.costs, Costs()
        self._host.clear()
        return costs

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    @contextlib.contextmanager
    def inside(self):
        """Count or time the work inside (the outermost entry only)."""
        self._depth += 1
        if self._depth > 1:
            try:
                yield
            finally:
                self._depth -= 1
            return
        cuda_allocations = _cuda_allocations()
        start = time.perf_counter()
        try:
            if self.counting:
                with _AllocationCounter(self.costs, self._host):
                    yield
            else:
                yield
        finally:
            self.seconds += time.perf_counter() - start
            if self.counting and cuda_allocations is not None:
                self.costs.allocations = max(self.costs.allocations, _cuda_allocations() - cuda_allocations)
            self._depth -= 1

    def _on_device(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu":
            return True
        return torch.cuda.is_available() is False and _storage(tensor) not in self._host

    def _patch_tensor_methods(self) -> None:
        for name in HOST_READS + TRANSFERS:
            self._patch(torch.Tensor, name, self._watched(name, getattr(torch.Tensor, name)))

    def _watched(self, name: str, original: Callable) -> Callable:
        counter = self

        @functools.wraps(original)
        def watched(tensor, *args, **kwargs):
            if not (counter.counting and counter._depth and counter._reading == 0):
                return original(tensor, *args, **kwargs)
            counter._reading += 1
            try:
                result = original(tensor, *args, **kwargs)
            finally:
                counter._reading -= 1
            if name in TRANSFERS:  # .to() the device a tensor is on (the CPU accelerator's) moves nothing
                moved = name == "cpu" or isinstance(result, torch.Tensor) and _storage(result) != _storage(tensor)
                if moved and isinstance(result, torch.Tensor) and _to_host(name, args, kwargs):
                    if counter._on_device(tensor):
                        counter._sync(name)
                    counter._host.add(_storage(result))
            elif counter._on_device(tensor):
                counter._sync(name)
            return result

        return watched

    def _patch_collectives(self) -> None:
        from deepspeed import comm

        for name in COLLECTIVES:
            if hasattr(comm, name):
                self._patch(comm, name, self._collective(getattr(comm, name)))

    def _collective(self, original: Callable) -> Callable:
        counter = self

        @functools.wraps(original)
        def counted(*args, **kwargs):
            if counter.counting and counter._depth:
                counter.costs.collectives += 1
            return original(*args, **kwargs)

        return counted

    def _sync(self, name: str) -> None:
        self.costs.syncs += 1
        self.costs.sync_sites.add(f"{_caller()}: {name}")

    def _patch_call_sites(self) -> None:
        from deepspeed_patch.adapters.attach import OPTIMIZER_FAMILIES
        from deepspeed_patch.adapters.base import LayerGradNormsAdapter
        from deepspeed_patch.adapters.param_grads import ParamGradAdapter
        from deepspeed_patch.hooks import CALL_SITES, AdapterCall

        names = {site.statement.name for site in CALL_SITES if isinstance(site.statement, AdapterCall)}
        for cls in (LayerGradNormsAdapter, ParamGradAdapter, *OPTIMIZER_FAMILIES):
            for name in names & set(vars(cls)):
                self._patch(cls, name, self.wrapped(vars(cls)[name]))

    def wrapped(self, function: Callable) -> Callable:
        """``function``, its work counted or timed."""

        @functools.wraps(function)
        def inside(*args, **kwargs):
            with self.inside():
                return function(*args, **kwargs)

        return inside


def _caller() -> str:
    """``file:line`` of the innermost frame of this project that made the read."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if ("deepspeed_patch" in path or "megatron_integration" in path) and "ledger" not in path:
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _to_host(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a ``.cpu()`` or ``.to(...)`` call asks for the host."""
    if name == "cpu":
        return True
    targets = [*args, kwargs.get("device")]
    return any(isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu" for target in targets)


def _cuda_allocations() -> Optional[int]:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.memory_stats().get("allocation.all.allocated", 0)


def model_config(layers: int, hidden: int):
    from megatron_integration.tiny_gpt import TinyGPTConfig

    return TinyGPTConfig(vocab_size=1024, seq_len=64, hidden=hidden, num_layers=layers, num_heads=8)


def build_engine(family: str, block: Optional[dict], layers: int, hidden: int):
    """A TinyGPT under ``family`` with ``block`` as its ``layer_grad_norms`` block, torch's AdamW (fp16
    without ZeRO: DeepSpeed runs it as FP16_UnfusedOptimizer), clipping at 1.0."""
    import deepspeed

    import deepspeed_patch
    from megatron_integration.tiny_gpt import TinyGPT

    deepspeed_patch.install()
    torch.manual_seed(0)
    model = TinyGPT(model_config(layers, hidden))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": NEVER,
        **FAMILIES[family]
    }
    if block is not None:
        config["layer_grad_norms"] = block
    engine, *_ = deepspeed.initialize(model=model,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      config=config)
    return engine


def _loss(engine, step: int, layers: int, hidden: int, spike: bool) -> torch.Tensor:
    from megatron_integration.tiny_gpt import synthetic_batch

    loss = engine(synthetic_batch(model_config(layers, hidden), 2, seed=step).to(engine.device))
    engine.backward(loss)
    return loss.detach() * (1e6 if spike else 1.0)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def attach_mode(engine, block: Optional[dict]):
    """Give ``engine`` a fresh adapter for the ``layer_grad_norms`` block ``block`` (``None``: none), as
    ``deepspeed.initialize`` would: one engine per family serves every mode."""
    from deepspeed_patch.adapters import attach
    from deepspeed_patch.config import load_config

    engine._config.layer_grad_norms_config = load_config({"layer_grad_norms": block} if block else {})
    engine.optimizer.layer_grad_norms = None
    engine.layer_grad_norms = attach(engine)
    return engine.layer_grad_norms


def mode_costs(counter: CallSiteCounter, engine, family: str, mode: str, steps: int, layers: int,
               hidden: int) -> Dict[str, Any]:
    """Counts of one counted step (the fire's step in ``fire``, else the third) and the median seconds inside
    the call sites over ``steps`` uncounted ones after it (``fire``: that step's)."""
    from deepspeed_patch.config import UnsupportedSetupError

    try:
        adapter = attach_mode(engine, MODES[mode])
    except UnsupportedSetupError:  # a trigger without a recorder in fp32 without ZeRO: no global norm
        return dict(_row(family, mode, None, [], "refused at initialize"), syncs=None, collectives=None)
    fire = mode == "fire"
    watches_loss = (MODES[mode] or {}).get("trigger", {}).get("loss_factor") is not None
    total = FIRE_AT if fire else steps + 3
    counted: Optional[Costs] = None
    seconds: List[float] = []
    for step in range(1, total + 1):
        spike = fire and step == FIRE_AT
        loss = _loss(engine, step, layers, hidden, spike)
        if watches_loss:
            adapter.report_loss(float(loss))  # a host loss: the counted step's sync is the trigger's own
        counting = step == (FIRE_AT if fire else 3)
        counter.counting = counting
        counter.take()
        _synchronize()
        engine.step()
        _synchronize()
        counter.counting = False
        costs = counter.take()
        spent = counter.take_seconds()
        if counting:
            counted = costs
        if steps and (step > 3 or fire and counting):
            seconds.append(spent)
    if fire and not (engine.get_layer_grad_norms_history() or []):
        raise RuntimeError(f"{family}: the trigger did not fire at step {FIRE_AT} of the mode")
    return _row(family, mode, counted, seconds, type(adapter).__name__ if adapter is not None else "-")


def hook_costs(counter: CallSiteCounter,
               engine,
               mode: str,
               layers: int,
               hidden: int,
               steps: int = 2) -> Dict[str, Any]:
    """The Megatron hook's counts on one iteration it does not log (``logged iteration``: one it logs), with
    Megatron's loss as a device tensor."""
    from megatron_integration.training_log import log_layer_grad_norms

    adapter = attach_mode(engine, HOOK_MODES[mode])
    args = argparse.Namespace(log_layer_grad_norms=True, log_interval=1)
    hook = counter.wrapped(log_layer_grad_norms)
    counted: Optional[Costs] = None
    for step in range(1, steps + 1):
        loss = _loss(engine, step, layers, hidden, False)
        engine.step()
        counter.counting = step == steps
        counter.take()
        hook(engine, engine.global_steps, None, args, loss=loss)
        counter.counting = False
        counted = counter.take()
    return _row("Megatron hook (ZeRO-2)", mode, counted, [], type(adapter).__name__ if adapter is not None else "-")


def _row(family: str, mode: str, costs: Optional[Costs], seconds: List[float], adapter: str) -> Dict[str, Any]:
    costs = costs or Costs()
    return {
        "family": family,
        "adapter": adapter,
        "mode": mode,
        "collectives": costs.collectives,
        "syncs": costs.syncs,
        "ops": costs.ops,
        "allocations": costs.allocations,
        "allocated_bytes": costs.allocated_bytes,
        "sync_sites": sorted(costs.sync_sites),
        "microseconds": statistics.median(seconds) * 1e6 if seconds else None
    }


def count_step_costs(plan: Optional[Dict[str, Sequence[str]]] = None,
                     hook_modes: Sequence[str] = tuple(HOOK_MODES),
                     steps: int = 0,
                     layers: int = 2,
                     hidden: int = 32) -> List[Dict[str, Any]]:
    """The modes ``plan`` names for each family (default: every family, every mode), and the hook's modes
    after ZeRO-2's: one row each, timed over ``steps`` steps after the counted one (0: counts only). Runs
    inside a launched rank."""
    plan = plan or {family: tuple(MODES) for family in FAMILIES}
    counter = CallSiteCounter()
    if not torch.cuda.is_available():  # DeepSpeed's CPU accelerator refuses fp16, whose kernels run there
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True
        get_accelerator().supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]
    rows = []
    for family, modes in plan.items():
        engine = build_engine(family, None, layers, hidden)
        rows += [mode_costs(counter, engine, family, mode, steps, layers, hidden) for mode in modes]
        if family == "ZeRO-2":
            rows += [hook_costs(counter, engine, mode, layers, hidden) for mode in hook_modes]
        engine.destroy()
    counter.close()
    return rows


def hook_dispatch_seconds(calls: int = 5000, rounds: int = 7) -> Dict[str, float]:
    """Seconds per call of a hooked method around the original's own: with no adapter, and with an adapter
    whose called method does nothing (the installed wrapper's own work: the argument look-up)."""
    from deepspeed_patch.hooks import START, AdapterCall
    from deepspeed_patch.patching import _wrapped

    class Adapter:

        def unscale_and_clip_grads(self, grad_groups_flat, total_norm) -> None:
            pass

    class Optimizer:
        layer_grad_norms = None

        def unscale_and_clip_grads(self, grad_groups_flat, total_norm, apply_scale=True):
            return None

    plain = Optimizer.unscale_and_clip_grads
    hooked = _wrapped(plain, START, AdapterCall(Adapter.unscale_and_clip_grads, ("grad_groups_flat", "total_norm")))
    optimizer = Optimizer()
    variants = {
        "original": (plain, None),
        "hooked, feature off": (hooked, None),
        "hooked, feature on": (hooked, Adapter())
    }
    best = {name: float("inf") for name in variants}
    for _ in range(rounds):  # the fastest round of each: the machine's other jobs only ever add time
        for name, (method, adapter) in variants.items():
            optimizer.layer_grad_norms = adapter
            start = time.perf_counter()
            for _ in range(calls):
                method(optimizer, [0], 1.0)
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
    return best


def table(rows: List[Dict[str, Any]]) -> List[str]:
    lines = [
        "| family (adapter) | mode | collectives | host syncs | allocations (bytes) | operators "
        "| µs inside the call sites | syncs at |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"
    ]
    for row in rows:
        micro = "" if row["microseconds"] is None else f"{row['microseconds']:.0f}"
        lines.append(f"| {row['family']} ({row['adapter']}) | {row['mode']} | {row['collectives']} | {row['syncs']} "
                     f"| {row['allocations']} ({row['allocated_bytes']}) | {row['ops']} | {micro} "
                     f"| {'; '.join(row['sync_sites'])} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks (collectives need two; rank 0's counts)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per family and mode")
    parser.add_argument("--quick", action="store_true", help="a small model (2 layers, hidden 32), 3 timed steps")
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    options = parser.parse_args()
    from common import RESULTS, machine, write_results

    from megatron_integration.cpu_launch import launch

    layers, hidden, steps = (2, 32, 3) if options.quick else (12, 256, options.steps)
    if options.device == "cuda":
        rows = _cuda_rank(steps, layers, hidden)
        where = f"one CUDA rank ({torch.cuda.get_device_name()}), NCCL"
    else:
        rows = launch(_cpu_rank, options.ranks, steps, layers, hidden, timeout=3600)[0]
        where = f"{options.ranks} CPU ranks (gloo; rank 0's counts), torch threads as set by default"
    dispatch = hook_dispatch_seconds()
    lines = [
        "# Per-step cost ledger",
        "",
        f"Machine: {machine()}; {where}.",
        "",
        f"TinyGPT, {layers} layers, hidden {hidden}, micro-batch 2 of 64 tokens, torch's AdamW, clipping 1.0 "
        "(`benchmarks/ledger.py`). Per family and mode, one step's collectives, host syncs, allocations and "
        "operators inside the call sites, counted; and "
        f"the median microseconds inside them over {steps} uncounted steps (fire: the one step). Modes: off (no "
        "`layer_grad_norms` block); quiet (`interval` never reached); trigger (a trigger that never fires); "
        "loss trigger (`grad_norm_factor: null`, a `loss_factor` never reached, a host loss reported every step); "
        f"control file (statistics off, a poll step of `control_interval: {CONTROL_INTERVAL}` that finds nothing "
        "new: its flag's all-reduce issued without waiting, the previous poll's read); "
        f"recorder (the trigger with `history: {HISTORY}`); measured (`interval: 1`); fire (the step whose "
        "loss spiked: the ring reduced). The Megatron hook rows count `log_layer_grad_norms` after an iteration, "
        "with Megatron's loss on the device.",
        "",
        *table(rows),
        "",
        f"A hooked method's own cost (`patching._wrapped`, no-op original, {len(dispatch)} variants): " +
        ", ".join(f"{name} {seconds * 1e9:.0f} ns" for name, seconds in dispatch.items()) + " per call.",
    ]
    write_results("ledger", lines, {"rows": rows, "dispatch": dispatch}, folder=options.out or RESULTS)
    print("\n".join(lines))


def _cpu_rank(steps: int, layers: int, hidden: int) -> List[Dict[str, Any]]:
    return count_step_costs(steps=steps, layers=layers, hidden=hidden)


def _cuda_rank(steps: int, layers: int, hidden: int) -> List[Dict[str, Any]]:
    import deepspeed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed(verbose=False)
    return count_step_costs(steps=steps, layers=layers, hidden=hidden)


if __name__ == "__main__":
    main()
