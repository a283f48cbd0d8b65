"""How often a 2-rank launch that finished its training aborts at exit, with and without the block.

The script launched is the README's quickstart made longer (20 ZeRO-2 steps, ``--steps``) and ending as most user
scripts and the HF Trainer do: without ``destroy_process_group`` (``--destroy``: with it). Launches alternate, with the
``layer_grad_norms`` block and without it, on one port, one at a time, through DeepSpeed's launcher
(``deepspeed --num_gpus 2``), as a user runs it. Per launch it keeps the launcher's return code, the
return code of the rank the launcher reports as failed (it stops the other one), whether each rank
finished its steps, and whether "terminate called" was printed.

    python benchmarks/exit_aborts.py --rounds 30 --label NAME [--trace] [--before-tree DIR] [--held]
        [--steps N] [--destroy]

writes ``results/exit_aborts_<label>.md`` and ``.json`` (after every launch). ``--before-tree``: a further
configuration, the block on with the package of another checkout (before a fix); ``--held``: one without the block
but with two all-reduces of tensors kept referenced after each step, as the statistics' are. Leave the machine
otherwise alone meanwhile: the abort is timing-dependent.
"""

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine, write_results  # noqa: E402

STEPS = 20
SCRIPT = """
import os
import deepspeed
import torch

import deepspeed_patch

deepspeed_patch.install()

model = torch.nn.Sequential()
model.add_module("embed", torch.nn.Linear(16, 32))
model.add_module("layers", torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)]))
model.add_module("head", torch.nn.Linear(32, 1))

ds_config = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
}
if os.environ["EXIT_ABORTS_BLOCK"] == "1":
    ds_config["layer_grad_norms"] = {"enabled": True, "layers": "0,1,mid,-2,-1", "interval": 1}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

HELD = []  # the held configuration's tensors, referenced as the statistics keep theirs (reduction._LAST_REDUCED)
for _ in range(int(os.environ["EXIT_ABORTS_STEPS"])):
    x = torch.randn(4, 16)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    if os.environ["EXIT_ABORTS_HELD"] == "1":
        HELD[:] = [torch.ones(8, 9), torch.ones(8, 3)]
        deepspeed.comm.all_reduce(HELD[0])
        deepspeed.comm.all_reduce(HELD[1], op=deepspeed.comm.ReduceOp.MAX)

stats = engine.get_layer_grad_norms()
print(f"EXIT_ABORTS rank {engine.global_rank} finished, statistics {stats is not None}", flush=True)
if os.environ["EXIT_ABORTS_DESTROY"] == "1":
    deepspeed.comm.destroy_process_group()
"""
ENDING = {"steps": STEPS, "destroy": False}
"""How a launch ends by default: after ``STEPS`` steps, without ``destroy_process_group``."""
FAILED_RANK = re.compile(r"--local_rank=(\d+)'?\]? exits with return code = (-?\d+)")


def launch(script: str, config: Dict, port: int, trace: str = "", ending: Dict = ENDING) -> Dict:
    """One launch of ``config`` (its ``block`` on or off, its ``held`` all-reduces, its package ``tree`` on
    PYTHONPATH) for ``ending["steps"]`` steps, ``ending["destroy"]``: with ``destroy_process_group`` at the end: its
    return codes and what the ranks printed; ``trace``: a library to preload into every process
    (``terminate_trace.cpp`` prints the thread that calls std::terminate, and its stack)."""
    env = dict(os.environ, EXIT_ABORTS_BLOCK=str(int(config["block"])), EXIT_ABORTS_HELD=str(int(config["held"])),
               EXIT_ABORTS_STEPS=str(ending["steps"]), EXIT_ABORTS_DESTROY=str(int(ending["destroy"])),
               PYTHONPATH=config["tree"])
    if trace:
        env["LD_PRELOAD"] = trace
    started = time.monotonic()
    result = subprocess.run(["deepspeed", "--num_gpus", "2", "--master_port", str(port), script],
                            capture_output=True, text=True, env=env, timeout=600)
    output = result.stdout + result.stderr
    failed = FAILED_RANK.search(output)
    return {
        "config": config["name"],
        "launcher_rc": result.returncode,
        "failed_rank": int(failed.group(1)) if failed else None,
        "failed_rank_rc": int(failed.group(2)) if failed else None,
        "finished": len(re.findall(r"EXIT_ABORTS rank \d finished, statistics " + str(config["block"]), output)),
        "terminate_called": output.count("terminate called"),
        "seconds": round(time.monotonic() - started, 1),
        "trace": [line for line in output.splitlines() if "TERMINATE_TRACE" in line or "(+0x" in line],
        "tail": output[-1500:] if result.returncode else "",
    }


def build_trace(folder: str) -> str:
    """``terminate_trace.cpp`` as a shared library in ``folder``; its path."""
    library = os.path.join(folder, "libterminate_trace.so")
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "terminate_trace.cpp")
    subprocess.run(["g++", "-O1", "-g", "-shared", "-fPIC", "-o", library, source], check=True)
    return library


def remove_buffers(port: int) -> None:
    """DeepSpeed's CPU all-reduce leaves one shared-memory buffer per rank and never unlinks it."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        os.remove(path)


def aborted(run: Dict) -> bool:
    """Whether a rank called std::terminate: the default handler's message, or the trace's."""
    return run["terminate_called"] > 0 or any("TERMINATE_TRACE" in line for line in run["trace"])


def table(label: str, configs: List[Dict], runs: List[Dict], traced: bool, ending: Dict = ENDING) -> List[str]:
    destroy = "then `destroy_process_group`" if ending["destroy"] else "no `destroy_process_group`"
    lines = [f"# Exit aborts: {label}", "", machine(), "",
             f"2 ranks, `deepspeed --num_gpus 2`, ZeRO-2, {ending['steps']} steps, {destroy}; launches "
             f"rotating through the configurations below, one port, one at a time"
             f"{'; terminate_trace.cpp preloaded' if traced else ''}.", "",
             "| configuration | launches | launcher rc 0 | both ranks finished | a rank aborted (std::terminate) | "
             "launcher rcs seen | failed rank rcs seen |", "|---|---|---|---|---|---|---|"]
    for config in configs:
        mine = [run for run in runs if run["config"] == config["name"]]
        lines.append(
            f"| {config['name']} | {len(mine)} | {sum(run['launcher_rc'] == 0 for run in mine)} | "
            f"{sum(run['finished'] == 2 for run in mine)} | {sum(aborted(run) for run in mine)} | "
            f"{sorted({run['launcher_rc'] for run in mine})} | "
            f"{sorted({run['failed_rank_rc'] for run in mine if run['failed_rank_rc'] is not None})} |")
    lines += ["", "Launches in order (configuration: launcher rc):", "",
              ", ".join(f"{run['config']}: {run['launcher_rc']}" for run in runs)]
    for number, run in enumerate(runs, 1):
        if run["trace"]:
            lines += ["", f"Launch {number} ({run['config']}), the thread that called std::terminate:", "", "```",
                      *run["trace"], "```"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="launches of each configuration")
    parser.add_argument("--port", type=int, default=29611)
    parser.add_argument("--label", required=True, help="names the result files: exit_aborts_<label>")
    parser.add_argument("--trace", action="store_true",
                        help="preload terminate_trace.cpp (built with g++) into every process")
    parser.add_argument("--before-tree", help="a checkout of the package before a fix: a third configuration, "
                        "the block on with that package")
    parser.add_argument("--held", action="store_true", help="a further configuration: the block off, two "
                        "all-reduces of tensors kept referenced after each step (as the statistics' are)")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--destroy", action="store_true", help="end with deepspeed.comm.destroy_process_group()")
    args = parser.parse_args()
    ending = {"steps": args.steps, "destroy": args.destroy}
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    configs = [{"name": "block on", "block": True, "held": False, "tree": here},
               {"name": "block off", "block": False, "held": False, "tree": here}]
    if args.before_tree:
        configs.append({"name": "block on, package before the fix", "block": True, "held": False,
                        "tree": args.before_tree})
    if args.held:
        configs.append({"name": "block off, two held all-reduces a step", "block": False, "held": True, "tree": here})
    runs: List[Dict] = []
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "exit_aborts_script.py")
        trace = build_trace(folder) if args.trace else ""
        with open(script, "w", encoding="utf-8") as out:
            out.write(SCRIPT)
        launch(script, configs[0], args.port, trace, ending)  # builds the JIT ops once, uncounted
        remove_buffers(args.port)
        for round_ in range(args.rounds):
            for config in configs[round_ % len(configs):] + configs[:round_ % len(configs)]:
                runs.append(launch(script, config, args.port, trace, ending))
                remove_buffers(args.port)
                run = runs[-1]
                print(f"{len(runs):3d} {config['name']}: launcher rc {run['launcher_rc']} finished {run['finished']} "
                      f"terminate {run['terminate_called']} {run['seconds']} s", flush=True)
                if run["launcher_rc"] or aborted(run):
                    print(run["tail"], *run["trace"], sep="\n", flush=True)
                # after every launch: a count stopped early still leaves its table
                write_results(f"exit_aborts_{args.label}", table(args.label, configs, runs, args.trace, ending),
                              {"runs": runs})


if __name__ == "__main__":
    main()
