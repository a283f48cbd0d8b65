"""The seed of PR 01 against the package, bit for bit: the same training, per-layer numbers compared with ``==``.

    python3 deepspeed_patch/upstream/seed/compare.py [--seed-ds /tmp/seed_ds] [--master /work/dsmaster]

Trains a tiny model (four ``layers.N.`` Linear layers of 768, an ``embed`` and a ``head`` outside the layers,
two parameter groups) for a few steps under ZeRO-2 (or ``--stage 1``), fp32, with gradient clipping that is
active at every step, on 2 CPU ranks (gloo; ``--world 1``; ``--world 3``: an uneven partition; ``--world 4``), with
the same seeds and data in each run (``--gas``, ``--interval``, ``--fp16``, ``--bf16``, ``--offload`` change the
set-up):

- ``seed``: DeepSpeed with the seed applied (``--seed-ds``), the ``layer_grad_norms`` key on; ``deepspeed_patch``
  not importable (checked);
- ``seed-off``: the same without the key: losses and final weights must equal the ``seed`` run's (no observer
  effect);
- ``seed-wired``: the seed's module, read from the series' PR 01 (``SEED_PATCH``), on an unmodified DeepSpeed
  (``--master``, or the installed one with ``--master ""``), called where the patch calls it: its statements
  wrapped around the methods they sit in, on the run's engine and optimizer only (``wire_seed``). CI runs this
  against the installed release, where the patch's call-site hunks do not apply (``tests/test_seed_compare.py``);
- ``package-stock``: unmodified DeepSpeed master (``--master``) with ``deepspeed_patch.install()``, the package's
  statistics forced onto its stock PyTorch path (``partition_stats.accumulate_spans``, what PR 02 ships);
- ``package-host``: the same with the package's default kernel on the host (the C++/OpenMP one, PR 10's).

Every layer's pre- and post-clip norm, min and max, and ``clip_coef``, ``step`` and ``overflow``, are compared
with ``==``; a difference is reported in ulps. Each run's ranks' results are compared with rank 0's too. Exit status
0 when the seed (``seed`` or ``seed-wired``) equals ``package-stock`` exactly, every run's ranks agree, and the seed
has no observer effect.
"""

import argparse
import hashlib
import itertools
import json
import math
import os
import socket
import struct
import subprocess
import sys
import tempfile

HIDDEN = 768
LAYERS = 4
STEPS = 4
BATCH = 4
CLIP = 0.05
RUNS = ("seed", "seed-off", "seed-wired", "package-stock", "package-host")
SEED_MODULE = "deepspeed/runtime/zero/layer_grad_norms.py"
# The seed is the upstream series' first pull request.
SEED_PATCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "series",
                          "01-zero12-layer-grad-norms.patch")
FIELDS = ("norm", "min", "max")


def build_model():
    import torch

    torch.manual_seed(1234)
    model = torch.nn.Sequential()
    model.add_module("embed", torch.nn.Linear(64, HIDDEN))
    model.add_module("layers", torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS)]))
    model.add_module("head", torch.nn.Linear(HIDDEN, 8))
    return model


def worker(args: argparse.Namespace) -> None:
    """One rank of the run ``args.worker``: train, write the results of rank ``RANK`` to ``args.out``."""
    run = args.worker
    import torch

    if run.startswith("package"):
        import deepspeed

        import deepspeed_patch

        if deepspeed.__version__ == "0.0.0":  # a source checkout (master) never built: its version.txt, for install()
            with open(os.path.join(os.path.dirname(os.path.dirname(deepspeed.__file__)), "version.txt")) as handle:
                deepspeed.__version__ = handle.read().strip()

        deepspeed_patch.install()
        if run == "package-stock":
            from deepspeed_patch.statistics import kernels

            kernels._best_kernel = lambda device: kernels.STOCK
    import deepspeed

    is_seed = os.path.isfile(os.path.join(os.path.dirname(os.path.dirname(deepspeed.__file__)), SEED_MODULE))
    assert is_seed == (run in ("seed", "seed-off")), (run, deepspeed.__file__)
    assert run.startswith("package") == ("deepspeed_patch" in sys.modules), run
    if args.fp16:  # DeepSpeed's CPU accelerator refuses fp16 (master's may not); its kernels work
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True
        get_accelerator().supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    model = build_model()
    groups = [{
        "params": [p for n, p in model.named_parameters() if n.endswith("weight")],
        "weight_decay": 0.01
    }, {
        "params": [p for n, p in model.named_parameters() if n.endswith("bias")],
        "weight_decay": 0.0
    }]
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_clipping": CLIP,
        "gradient_accumulation_steps": args.gas,
        "zero_optimization": {
            "stage": args.stage
        },
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-3,
                "torch_adam": True
            }
        },
    }
    if args.fp16:  # a small scale window: steps that overflow, and steps at which the loss scale grows
        config["fp16"] = {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 2, "hysteresis": 1}
    if args.bf16:
        config["bf16"] = {"enabled": True}
    if args.offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False  # torch's AdamW on the host partitions: no op to build
    if run not in ("seed-off", "seed-wired"):
        config["layer_grad_norms"] = {"enabled": True, "interval": args.interval}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    if run == "seed-wired":
        wire_seed(engine, args.seed_module, args.interval)
    data = torch.Generator().manual_seed(99 + rank)
    losses, results = [], []
    dtype = torch.half if args.fp16 else torch.bfloat16 if args.bf16 else torch.float
    for _ in range(STEPS * (2 if args.fp16 else 1) * args.interval):
        for _ in range(args.gas):
            x = torch.randn(BATCH, 64, generator=data).to(dtype)
            loss = engine(x).sin().pow(2).mean() * 1000.0
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        results.append(engine.get_layer_grad_norms())
        if results[-1] is not None:
            results[-1]["loss_scale"] = float(engine.optimizer.loss_scale)
    weights = torch.cat([p.detach().reshape(-1).float() for p in engine.module.parameters()])
    with open(args.out, "w") as handle:
        json.dump(
            {
                "losses": losses,
                "results": results,
                "weights": hashlib.sha256(weights.numpy().tobytes()).hexdigest(),
                "setup": set_up(engine),
                "deepspeed": deepspeed.__file__
            }, handle)
    os._exit(0)  # past torch's exit-time gloo abort (upstream/bug_reports/gloo_exit_abort.md): the results are written


def wire_seed(engine, module_path: str, interval: int) -> None:
    """The seed's module at ``module_path`` on an unmodified DeepSpeed, called where the seed's patch calls it: the
    patch's statements around the methods they sit in (``unscale_and_clip_grads``, ``_update_scale`` in ``step``,
    the engine's ``_take_model_step``), on this engine and its optimizer only."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("seed_layer_grad_norms", module_path)
    seed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seed)
    optimizer = engine.optimizer
    stats = seed.LayerGradNorms(optimizer, seed.LayerGradNormsConfig(enabled=True, interval=interval))
    unscale_and_clip_grads, update_scale, take_model_step = (optimizer.unscale_and_clip_grads,
                                                             optimizer._update_scale, engine._take_model_step)

    def observed_unscale_and_clip_grads(grad_groups_flat, total_norm):
        stats.observe(grad_groups_flat[0], total_norm)
        return unscale_and_clip_grads(grad_groups_flat, total_norm)

    def observed_update_scale(has_overflow=False):
        if optimizer.overflow:
            stats.observe_overflow()
        return update_scale(has_overflow)

    def measured_take_model_step(*args, **kwargs):
        stats.begin_step(engine.global_steps + 1)
        take_model_step(*args, **kwargs)
        stats.end_step(optimizer.overflow)

    optimizer.unscale_and_clip_grads = observed_unscale_and_clip_grads
    optimizer._update_scale = observed_update_scale
    engine._take_model_step = measured_take_model_step
    engine.get_layer_grad_norms = lambda: stats.result


def seed_module_text(patch: str) -> str:
    """The seed's module, the one file the seed's patch adds under ``deepspeed/runtime/zero/``."""
    section = patch.split(f"+++ b/{SEED_MODULE}\n", 1)[1].split("\ndiff --git ", 1)[0]
    return "".join(line[1:] + "\n" for line in section.splitlines() if line.startswith("+"))


def set_up(engine) -> str:
    """What the run measured, as the optimizer holds it: its class, offload, the fp32 partition's dtype and device."""
    optimizer = engine.optimizer
    partition = optimizer.single_partition_of_fp32_groups[0]
    return (f"{type(optimizer).__name__}, cpu_offload={optimizer.cpu_offload}, partition {partition.dtype} on "
            f"{partition.device}, model {next(engine.module.parameters()).dtype}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(run: str, args: argparse.Namespace, pythonpath: str, directory: str) -> list:
    """Every rank of ``run``; their results, rank 0 first."""
    env = dict(os.environ,
               PYTHONPATH=pythonpath,
               MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(args.world),
               OMP_NUM_THREADS="1")
    if run in ("seed", "seed-off") or args.master:  # a checkout's ops: a build folder of their own, not the release's
        env.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/seed_ext")
    outs = [os.path.join(directory, f"{run}-{rank}.json") for rank in range(args.world)]
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", run, "--out", outs[rank]] + worker_flags(args),
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=subprocess.DEVNULL,
            stderr=open(outs[rank] + ".log", "w")) for rank in range(args.world)
    ]
    for proc, out in zip(procs, outs):
        proc.wait(timeout=900)
        if not os.path.exists(out):
            sys.exit(f"{run}: rank failed (exit {proc.returncode}); log in {out}.log")
    loaded = []
    for out in outs:
        with open(out) as handle:
            loaded.append(json.load(handle))
    return loaded


def worker_flags(args: argparse.Namespace) -> list:
    """The set-up's options, as a worker is given them."""
    flags = ["--stage", str(args.stage), "--gas", str(args.gas), "--interval", str(args.interval)]
    flags += ["--seed-module", args.seed_module] if args.seed_module else []
    return flags + [f"--{name}" for name in ("fp16", "bf16", "offload") if getattr(args, name)]


def equal(a, b) -> bool:
    """``a == b``, or both NaN (JSON keeps no NaN payload): an overflowed step's statistics."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def ulps(a: float, b: float) -> int:
    """The distance of two float64 values in units in the last place."""
    if a == b:
        return 0
    if not (math.isfinite(a) and math.isfinite(b)):
        return -1
    return abs(_ordered(a) - _ordered(b))


def _ordered(x: float) -> int:
    """The float64 ``x`` as an integer of the same order, consecutive floats consecutive integers."""
    bits = struct.unpack("<q", struct.pack("<d", x))[0]
    return bits if bits >= 0 else -(bits & 0x7FFFFFFFFFFFFFFF)


def compare(name_a: str, a: list, name_b: str, b: list) -> dict:
    """Per field, the compared values and how many differ, with the largest difference in ulps."""
    counts = {}
    lines = []
    for step_a, step_b in zip(a, b):
        assert (step_a is None) == (step_b is None)
        if step_a is None:
            continue
        for field in ("step", "overflow", "clip_coef", "loss_scale"):
            entry = counts.setdefault(field, [0, 0, 0])
            entry[0] += 1
            if not equal(step_a[field], step_b[field]):
                entry[1] += 1
                if isinstance(step_a[field], float):
                    entry[2] = max(entry[2], ulps(step_a[field], step_b[field]))
                lines.append(f"  step {step_a['step']} {field}: {step_a[field]!r} != {step_b[field]!r}")
        for phase in ("pre_clip", "post_clip"):
            if step_a[phase] is None or step_b[phase] is None:  # the seed reads nothing on an overflowed step
                if (step_a[phase] is None) != (step_b[phase] is None):
                    lines.append(f"  step {step_a['step']} {phase}: one run only (overflow: {step_a['overflow']})")
                    counts.setdefault(f"{phase} missing", [0, 0, 0])[1] += 1
                continue
            assert set(step_a[phase]) == set(step_b[phase]), (step_a[phase].keys(), step_b[phase].keys())
            for key in step_a[phase]:
                for field in FIELDS:
                    x, y = step_a[phase][key][field], step_b[phase][key][field]
                    entry = counts.setdefault(f"{phase}.{field}", [0, 0, 0, 0.0])
                    entry[0] += 1
                    if not equal(x, y):
                        entry[1] += 1
                        entry[2] = max(entry[2], ulps(x, y))
                        entry[3] = max(entry[3], abs(x - y) / max(abs(x), abs(y)))
                        lines.append(f"  step {step_a['step']} {phase} {key} {field}: {x!r} != {y!r} "
                                     f"({ulps(x, y)} ulp)")
    print(f"{name_a} vs {name_b}:")
    for field, (total, differing, worst, *relative) in counts.items():
        worst_text = f", at most {worst} ulp" + (f" (relative {relative[0]:.1e})" if relative else "")
        print(f"  {field:16s} {total:3d} compared, {differing:3d} differ" + (worst_text if differing else ""))
    for line in lines[:20]:
        print(line)
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", choices=RUNS)
    parser.add_argument("--out")
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2))
    parser.add_argument("--fp16", action="store_true", help="fp16 with dynamic loss scaling, twice the steps")
    parser.add_argument("--bf16", action="store_true", help="bf16 (the ZeRO optimizer, fp32 partitions)")
    parser.add_argument("--gas", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--interval", type=int, default=1, help="the key's interval: measure every N-th step")
    parser.add_argument("--offload", action="store_true", help="the optimizer offloaded to the CPU")
    parser.add_argument("--seed-ds", default="/tmp/seed_ds")
    parser.add_argument("--master", default="/work/dsmaster", help='unmodified DeepSpeed; "": the installed one')
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--world", type=int, default=2, choices=(1, 2, 3, 4), help="ranks (3: an uneven partition)")
    parser.add_argument("--out-dir", help="where each rank's results and log go (default: a new temporary folder)")
    parser.add_argument("--seed-patch", default=SEED_PATCH,
                        help="where seed-wired reads the seed's module from")
    parser.add_argument("--seed-module", help=argparse.SUPPRESS)  # a worker's: the seed's module, for seed-wired
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    paths = {"seed": args.seed_ds, "seed-off": args.seed_ds}
    runs = {}
    directory = args.out_dir or tempfile.mkdtemp(prefix="seed_compare_")  # each rank's results and log, kept
    os.makedirs(directory, exist_ok=True)
    args.seed_module = os.path.join(directory, "seed_layer_grad_norms.py")
    with open(args.seed_patch) as patch, open(args.seed_module, "w") as module:
        module.write(seed_module_text(patch.read()))
    for run in args.runs.split(","):
        path = paths.get(run, os.pathsep.join(filter(None, (package, args.master))))
        runs[run] = launch(run, args, path, directory)
        print(f"{run}: ran on {runs[run][0]['deepspeed']}: {runs[run][0]['setup']}", flush=True)
    for run, (rank0, *others) in runs.items():
        same = all(rank0["results"] == other["results"] for other in others)
        print(f"{run}: every rank's results identical to rank 0's: {same}")
    ok = all(rank0["results"] == other["results"] for rank0, *others in runs.values() for other in others)
    if "seed" in runs and "seed-off" in runs:
        same = all(runs["seed"][r]["losses"] == runs["seed-off"][r]["losses"]
                   and runs["seed"][r]["weights"] == runs["seed-off"][r]["weights"] for r in range(args.world))
        print(f"seed with the key on vs off: losses and final weights bit-identical: {same}")
        ok &= same
    for seed, other in itertools.product(("seed", "seed-wired"), ("package-stock", "package-host")):
        if seed in runs and other in runs:
            counts = compare(seed, runs[seed][0]["results"], other, runs[other][0]["results"])
            exact = all(entry[1] == 0 for entry in counts.values())
            print(f"{seed} == {other} on every field: {exact}")
            same_training = runs[seed][0]["losses"] == runs[other][0]["losses"]
            print(f"{seed} and {other} trained identically (losses): {same_training}")
            if other == "package-stock":
                ok &= exact
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
