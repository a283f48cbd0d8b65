"""The ``layer-grad-norms`` command.

Its stdout carries results only (``report --json`` is piped into other tools): DeepSpeed logs to
stdout, from its import on (the accelerator it picked), so the modules that import it are imported
with stdout sent to stderr, where DeepSpeed's logger, which keeps the stream it was made with, stays. DeepSpeed's
notice that it found no GPU and fell back to the CPU, logged at its import, is dropped (``cpu_launch``): these
commands use no accelerator, and the demo's ranks are CPU ranks by design.
"""

import argparse
import contextlib
import json
import os
import sys
from typing import List, Optional

from .cpu_launch import quiet_cpu_fallback_notice

quiet_cpu_fallback_notice()
with contextlib.redirect_stdout(sys.stderr):
    from deepspeed_patch.config import LayerGradNormsConfigError, parse_layer_spec
    from deepspeed_patch.layer_map import resolve_layers
    from deepspeed_patch.spike_rule import WARM_UP
    from deepspeed_patch.upstream.apply import COMMANDS, run_patch_command

    from .arguments import LAYER_FLAG_FORMS
    from .demo import DEMO_REMEDIES, LR_SPIKE, SPIKE_HISTORY, DemoOptions, run_demo
    from .fires import read_fires
    from .fork_e2e.run import E2EOptions, run_e2e, summary_markdown
    from .fork_e2e.setups import SETUPS
    from .log_sources import READABLE, LogSourceError
    from .plot import plot_run, plot_spike_history
    from .report import format_report, summarize_source
    from .spike import localise_all


class _Parser(argparse.ArgumentParser):
    """Bad input is one line on stderr and exit code 2, as ``main``'s own checks give (``--help`` shows usage)."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _layer_spec(value: str) -> str:
    try:
        parse_layer_spec(value)
    except ValueError as err:
        reason = str(err).split("; expected")[0]
        raise argparse.ArgumentTypeError(f"{value!r}: {reason}; expected {LAYER_FLAG_FORMS}") from None
    return value


def _positive(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive integer")
    return int(value)


def _spike(value: str) -> tuple:
    step, _, layer = value.partition(":")
    if not (step.isdigit() and layer.isdigit()):
        raise argparse.ArgumentTypeError(f"{value!r}: expected STEP:LAYER, two non-negative integers (10:3)")
    return int(step), int(layer)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="layer-grad-norms",
                     description="Per-layer gradient statistics inside DeepSpeed's optimizers (ZeRO-1/2/3, "
                     "BF16_Optimizer, the fp16 optimizers, stage 0, offload), read by Megatron-DeepSpeed and "
                     "the Hugging Face Trainer.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a tiny GPT under ZeRO on CPU ranks and show per-layer grad norms",
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = DemoOptions()
    demo.add_argument("--steps", type=_positive, default=defaults.steps, help="optimizer steps")
    demo.add_argument("--num-layers", type=_positive, default=defaults.num_layers, help="transformer layers")
    demo.add_argument("--hidden", type=_positive, default=defaults.hidden, help="a multiple of 4 (attention heads)")
    demo.add_argument("--zero-stage", type=int, choices=(1, 2), default=defaults.zero_stage, help="ZeRO stage")
    demo.add_argument("--world-size", type=_positive, default=defaults.world_size, help="CPU ranks")
    demo.add_argument("--arch", choices=("preln", "postln"), default=defaults.arch,
                      help="where the layer norm sits: before each sublayer (Pre-LN) or after its residual sum")
    demo.add_argument("--layers", type=_layer_spec, default=defaults.layers,
                      help=f"layers to report: {LAYER_FLAG_FORMS}")
    demo.add_argument("--out", default=defaults.out, help="directory for TensorBoard, the figure and the report")
    demo.add_argument("--spike", type=_spike, metavar="STEP:LAYER",
                      help="inject a gradient spike into transformer layer LAYER at optimizer step STEP, with a "
                      f"flight recorder of {SPIKE_HISTORY} steps and the optimizer's statistics; the report and "
                      "spike_history.png localise it and name the gradient as the signal that moved first")
    demo.add_argument("--lr-spike", type=_positive, metavar="STEP",
                      help=f"multiply the learning rate by {LR_SPIKE:g} at optimizer step STEP only, with a flight "
                      f"recorder of {SPIKE_HISTORY} steps and the optimizer's statistics: the spike starts in the "
                      "update, and the report names it")
    demo.add_argument("--remedy", choices=tuple(DEMO_REMEDIES),
                      help="turn a remedy on: adaptive (adaptive_clipping, warm-up 20 steps) or skip (skip_step, "
                      "window 20; with --spike after step 20 it skips the spiking step); the report and figure show "
                      "what it did")
    logdir_help = (f"{READABLE}: a TensorBoard directory written by log_layer_grad_norms, DeepSpeed's monitor or "
                   "the Hugging Face Trainer (its output directory or one run), its trainer_state.json, a JSONL dump "
                   "with its rotated files, or a directory of CSV monitor files")
    plot = commands.add_parser("plot", help="draw the per-layer gradient-norm figure of a run's log")
    plot.add_argument("logdir", help=logdir_help)
    plot.add_argument("-o", "--output", help="PNG or SVG file (default: layer_grad_norms.png, or spike_history.png "
                      "with --history, in LOGDIR or beside the dump)")
    plot.add_argument("--history", action="store_true",
                      help="draw instead the flight recorder's steps of each fire of the trigger, every layer: the "
                      "gradient, the update-to-weight ratio where the log holds it, and each layer's rise")
    report = commands.add_parser("report", help="per-layer medians, early/late ratio, clipping, overflow")
    report.add_argument("logdir", help=logdir_help)
    report.add_argument("--json", action="store_true", help="print the report as JSON")
    add_e2e_parser(commands)
    patch = commands.add_parser("patch", help="apply, check or revert the upstream patch in a DeepSpeed tree")
    patch.add_argument("action", choices=COMMANDS,
                       help="apply: add the feature to DeepSpeed's source, so that no install() is needed (a no-op "
                       "when applied; all hunks or none); check: exit 0 when applied, 1 when not; revert: take it "
                       "out, restoring the files byte for byte")
    patch.add_argument("--deepspeed", help="a DeepSpeed checkout, or the directory holding the deepspeed package "
                       "(default: the installed one)")
    return parser


def add_e2e_parser(commands) -> None:
    e2e = commands.add_parser("megatron-e2e", help="train a Megatron-DeepSpeed checkout's own pretrain_gpt.py on 2 or "
                              "8 CPU ranks in each set-up and check its per-layer log line and TensorBoard")
    defaults = E2EOptions(fork="")
    e2e.add_argument("--fork", required=True, help="root of a Megatron-DeepSpeed checkout, with the patch applied")
    e2e.add_argument("--setups", type=_setup_list, default=",".join(defaults.setups),
                     help=f"comma-separated, from {', '.join(SETUPS)} (default: all)")
    e2e.add_argument("--out", default=defaults.out,
                     help="directory for the data, each set-up's ds_config, command, log and TensorBoard, and "
                     f"summary.md and summary.json (default: {defaults.out})")
    e2e.add_argument("--python", default=defaults.python,
                     help="the ranks' interpreter, with DeepSpeed and the fork's requirements (default: this one)")
    e2e.add_argument("--train-iters", type=_positive, default=defaults.train_iters,
                     help=f"iterations of each set-up's training run (default: {defaults.train_iters})")
    e2e.add_argument("--layers", type=_layer_spec, default=defaults.layers,
                     help="--layer-grad-norms-layers; the root-sum-square check needs all (the default)")
    e2e.add_argument("--timeout", type=_positive, default=int(defaults.timeout),
                     help="seconds each set-up may run before it is stopped and counted as failed (default: "
                     f"{int(defaults.timeout)})")
    e2e.add_argument("--apply-patch", choices=("microsoft", "bigscience"),
                     help="git apply this patch to the fork first")


def _setup_list(value: str) -> tuple:
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    unknown = [name for name in names if name not in SETUPS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{value!r}: unknown set-up {unknown}; choose from {', '.join(SETUPS)}")
    return names


def run_e2e_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not os.path.isdir(args.fork):
        parser.error(f"--fork {args.fork}: no such directory")
    options = E2EOptions(fork=args.fork, setups=args.setups, out=args.out, python=args.python,
                         train_iters=args.train_iters, layers=args.layers, timeout=args.timeout,
                         apply_patch=args.apply_patch)
    summary = run_e2e(options)
    print(summary_markdown(summary))
    if not summary["passed"]:
        parser.exit(1, f"layer-grad-norms megatron-e2e: a set-up failed; see {args.out}/summary.md\n")


def main(argv: Optional[List[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "patch":
            parser.exit(run_patch_command(args.action, args.deepspeed))
        elif args.command == "plot":
            print(f"figure: {plot_command(parser, args)}")
        elif args.command == "megatron-e2e":
            run_e2e_command(parser, args)
        elif args.command == "report":
            summary = summarize_source(args.logdir)
            print(json.dumps(summary, indent=2) if args.json else format_report(summary))
        else:
            run_demo_command(parser, args)
    except LogSourceError as err:
        parser.exit(2, f"layer-grad-norms {args.command}: {err}\n")
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback; the demo's ranks are stopped (cpu_launch.launch)
        parser.exit(130, f"\nlayer-grad-norms {args.command}: interrupted\n")


def plot_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """Draw the figure ``plot`` asks for; returns its path. The output is checked before the log is read."""
    folder = args.logdir if os.path.isdir(args.logdir) else os.path.dirname(args.logdir)
    output = args.output or os.path.join(folder, "spike_history.png" if args.history else "layer_grad_norms.png")
    _check_output(parser, output)
    if not args.history:
        figure = plot_run(args.logdir, output)
    else:
        fires = read_fires(args.logdir)
        if not fires:
            parser.exit(2, f"layer-grad-norms plot --history: {args.logdir}: no fire of the trigger with a flight "
                        "recorder (trigger.history) is recorded there\n")
        figure = plot_spike_history(fires, localise_all(fires), output)
    from matplotlib import pyplot

    pyplot.close(figure)
    return output


def _check_output(parser: argparse.ArgumentParser, output: str) -> None:
    """A figure's file: a format matplotlib writes, in a directory that exists."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    extension = os.path.splitext(output)[1].lstrip(".").lower()
    if extension not in formats:
        parser.exit(2, f"layer-grad-norms plot: -o {output}: unknown figure format {extension!r}; use one of "
                    f"{', '.join(sorted(formats))} (png or svg, say)\n")
    folder = os.path.dirname(output) or "."
    if not os.path.isdir(folder):
        parser.exit(2, f"layer-grad-norms plot: -o {output}: the directory {folder} does not exist\n")
    if not os.access(folder, os.W_OK):
        parser.exit(2, f"layer-grad-norms plot: -o {output}: the directory {folder} is not writable\n")


def run_demo_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every option is checked here, before any rank is launched."""
    if args.hidden % 4:
        parser.error(f"--hidden {args.hidden}: must be a multiple of 4 (the number of attention heads)")
    if args.spike is not None:
        step, layer = args.spike
        if not WARM_UP < step <= args.steps:
            parser.error(f"--spike {step}:{layer}: the step must be from {WARM_UP + 1} (the trigger judges after "
                         f"{WARM_UP} steps) to --steps {args.steps}")
        if layer >= args.num_layers:
            parser.error(f"--spike {step}:{layer}: the layer must be below --num-layers {args.num_layers}")
    if args.lr_spike is not None and not WARM_UP <= args.lr_spike < args.steps:
        parser.error(f"--lr-spike {args.lr_spike}: the step must be from {WARM_UP} to --steps {args.steps} - 1 (its "
                     f"gradient spike comes at the next step, and the trigger judges after {WARM_UP} steps)")
    selection = parse_layer_spec(args.layers)
    try:
        layers = set(resolve_layers(selection, args.num_layers)) if selection else set(range(args.num_layers))
    except LayerGradNormsConfigError as err:
        parser.error(f"--layers {args.layers}: {str(err).split(': ', 1)[1]} (--num-layers {args.num_layers})")
    if len(layers) < 2:
        parser.error(f"--layers {args.layers}: the report compares the first two logged layers with the last two; "
                     "select at least 2 layers")
    options = DemoOptions(steps=args.steps, num_layers=args.num_layers, hidden=args.hidden,
                          zero_stage=args.zero_stage, world_size=args.world_size, arch=args.arch,
                          layers=args.layers, out=args.out, spike=args.spike, lr_spike=args.lr_spike,
                          remedy=args.remedy)
    print(run_demo(options))


if __name__ == "__main__":
    main()
