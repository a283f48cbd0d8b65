"""The ``layer-grad-norms`` command.

Its stdout carries results only (``report --json`` is piped into other tools): DeepSpeed logs to
stdout, from its import on (the accelerator it picked), so the modules that import it are imported
with stdout sent to stderr, where DeepSpeed's logger, which keeps the stream it was made with, stays. DeepSpeed's
notice that it found no GPU and fell back to the CPU, logged at its import, is dropped (``cpu_launch``): these
commands use no accelerator, and the demo's ranks are CPU ranks by design.
"""

import argparse
import contextlib
import csv
import json
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Iterator, List, Optional

from .cpu_launch import quiet_cpu_fallback_notice

quiet_cpu_fallback_notice()
with contextlib.redirect_stdout(sys.stderr):
    from deepspeed_patch.config import LayerGradNormsConfigError, parse_layer_spec
    from deepspeed_patch.spikes.spike_rule import WARM_UP
    from deepspeed_patch.statistics.layer_map import resolve_layers
    from deepspeed_patch.upstream.apply import COMMANDS, run_patch_command

    from .arguments import LAYER_FLAG_FORMS, layer_selection, positive_int
    from .demo import DEMO_REMEDIES, LR_SPIKE, SPIKE_HISTORY, DemoOptions, run_demo
    from .fires import read_fires
    from .fork_e2e.run import E2EOptions, run_e2e, summary_markdown
    from .fork_e2e.setups import SETUPS
    from .log_sources import READABLE, LogSourceError
    from .plot import plot_run, plot_spike_history
    from .report import csv_rows, format_report, summarize_source
    from .spike import localise_all
    from .tensorboard_reader import read_layer_series


class _Parser(argparse.ArgumentParser):
    """Bad input is one line on stderr and exit code 2, as ``main``'s own checks give (``--help`` shows usage)."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _spike(value: str) -> tuple:
    step, _, layer = value.partition(":")
    if not (step.isdigit() and layer.isdigit()):
        raise argparse.ArgumentTypeError(f"{value!r}: expected STEP:LAYER, two non-negative integers (10:3)")
    return int(step), int(layer)


RUN_HELP = ("the training run to read, where LOGDIR holds several (a Megatron TensorBoard root, a folder of demos): "
            "its folder under LOGDIR, as the refusal names it")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="layer-grad-norms",
                     description="Per-layer gradient statistics inside DeepSpeed's optimizers (ZeRO-1/2/3, "
                     "BF16_Optimizer, the fp16 optimizers, stage 0, offload), read by Megatron-DeepSpeed and "
                     "the Hugging Face Trainer.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a tiny GPT under ZeRO on CPU ranks and show per-layer grad norms",
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = DemoOptions()
    demo.add_argument("--steps", type=positive_int, default=defaults.steps, help="optimizer steps")
    demo.add_argument("--num-layers", type=positive_int, default=defaults.num_layers, help="transformer layers")
    demo.add_argument("--hidden", type=positive_int, default=defaults.hidden, help="a multiple of 4 (attention heads)")
    demo.add_argument("--zero-stage", type=int, choices=(1, 2), default=defaults.zero_stage, help="ZeRO stage")
    demo.add_argument("--world-size", type=positive_int, default=defaults.world_size, help="CPU ranks")
    demo.add_argument("--arch", choices=("preln", "postln"), default=defaults.arch,
                      help="where the layer norm sits: before each sublayer (Pre-LN) or after its residual sum")
    demo.add_argument("--layers", type=layer_selection, default=defaults.layers,
                      help=f"layers to report: {LAYER_FLAG_FORMS}")
    demo.add_argument("--out", default=defaults.out, help="directory for TensorBoard, the figure and the report")
    demo.add_argument("--spike", type=_spike, metavar="STEP:LAYER",
                      help="inject a gradient spike into transformer layer LAYER at optimizer step STEP, with a "
                      f"flight recorder of {SPIKE_HISTORY} steps and the optimizer's statistics; the report and "
                      "spike_history.png localise it and name the gradient as the signal that moved first")
    demo.add_argument("--lr-spike", type=positive_int, metavar="STEP",
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
    plot.add_argument("--run", metavar="NAME", help=RUN_HELP)
    plot.add_argument("--layers", type=layer_selection, default="all",
                      help=f"layers to draw, by their index in the log: {LAYER_FLAG_FORMS} (mid and negative indices "
                      "count from the deepest logged layer)")
    plot.add_argument("--history", action="store_true",
                      help="draw instead the flight recorder's steps of each fire of the trigger, every layer: the "
                      "gradient, the update-to-weight ratio where the log holds it, and each layer's rise")
    report = commands.add_parser("report", help="per-layer medians, early/late ratio, clipping, overflow")
    report.add_argument("logdir", help=logdir_help)
    report.add_argument("--run", metavar="NAME", help=RUN_HELP)
    output = report.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the report as JSON")
    output.add_argument("--csv", action="store_true",
                        help="print instead every logged value as CSV: one row per step and layer, a column per "
                        "phase and statistic")
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
    e2e.add_argument("--train-iters", type=positive_int, default=defaults.train_iters,
                     help=f"iterations of each set-up's training run (default: {defaults.train_iters})")
    e2e.add_argument("--layers", type=layer_selection, default=defaults.layers,
                     help="--layer-grad-norms-layers; the root-sum-square check needs all (the default)")
    e2e.add_argument("--timeout", type=positive_int, default=int(defaults.timeout),
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
    if getattr(args, "run", None) is not None:
        args.logdir = _run_folder(parser, args)
    try:
        if args.command == "patch":
            parser.exit(run_patch_command(args.action, args.deepspeed))
        elif args.command == "plot":
            print(f"figure: {plot_command(parser, args)}")
        elif args.command == "megatron-e2e":
            run_e2e_command(parser, args)
        elif args.command == "report":
            report_command(args)
        else:
            run_demo_command(parser, args)
    except LogSourceError as err:
        parser.exit(2, f"layer-grad-norms {args.command}: {err}\n")
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback; the demo's ranks are stopped (cpu_launch.launch)
        parser.exit(130, f"\nlayer-grad-norms {args.command}: interrupted\n")
    except BrokenPipeError:  # ``report | head``: the reader has what it wanted; end quietly, as if by SIGPIPE
        _discard_stdout()
        parser.exit(128 + signal.SIGPIPE)


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's flush at exit finds no closed pipe (and prints
    nothing), as Python's documentation of SIGPIPE advises."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def report_command(args: argparse.Namespace) -> None:
    """``report``: the text, ``--json`` or ``--csv`` on stdout."""
    with reading_notice(f"layer-grad-norms report: reading {args.logdir}"):
        if args.csv:
            rows = list(csv_rows(read_layer_series(args.logdir)))
        else:
            summary = summarize_source(args.logdir)
    if args.csv:
        csv.writer(sys.stdout, lineterminator="\n").writerows(rows)
    else:
        print(json.dumps(summary, indent=2) if args.json else format_report(summary))


NOTICE_AFTER = 3.0
"""Seconds of a read before ``reading_notice`` says it is under way (at once on a terminal)."""
NOTICE_EVERY = 10.0
"""Seconds between its lines when stderr is no terminal (on one, it redraws its line every second)."""


@contextlib.contextmanager
def reading_notice(what: str) -> Iterator[None]:
    """While the block reads a log: on a terminal, ``what`` and the seconds so far, redrawn every second on
    stderr and cleared at the end; elsewhere one line after ``NOTICE_AFTER`` seconds and one every
    ``NOTICE_EVERY``. Nothing for a read shorter than that: a large folder takes half a minute, in silence
    otherwise."""
    terminal, start, done = sys.stderr.isatty(), time.monotonic(), threading.Event()

    def tell() -> None:
        wait = 1.0 if terminal else NOTICE_AFTER
        while not done.wait(wait):
            elapsed = time.monotonic() - start
            sys.stderr.write(f"\r{what} ({elapsed:.0f} s)" if terminal else f"{what} ({elapsed:.0f} s so far)\n")
            sys.stderr.flush()
            wait = 1.0 if terminal else NOTICE_EVERY

    teller = threading.Thread(target=tell, daemon=True)
    teller.start()
    try:
        yield
    finally:
        done.set()
        teller.join()
        if terminal and time.monotonic() - start >= 1.0:
            sys.stderr.write("\r\033[K")


def _run_folder(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The folder of ``--run NAME`` under LOGDIR."""
    folder = os.path.normpath(os.path.join(args.logdir, args.run))
    if not os.path.isdir(args.logdir) or not os.path.isdir(folder):
        parser.exit(2, f"layer-grad-norms {args.command}: --run {args.run}: no such run folder in {args.logdir}\n")
    return folder


def plot_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """Draw the figure ``plot`` asks for; returns its path. The output is checked before the log is read."""
    folder = args.logdir if os.path.isdir(args.logdir) else os.path.dirname(args.logdir)
    output = args.output or os.path.join(folder, "spike_history.png" if args.history else "layer_grad_norms.png")
    _check_output(parser, output)
    if args.history and args.layers != "all":
        parser.error("--layers: plot --history draws every layer of each fire")
    with reading_notice(f"layer-grad-norms plot: reading {args.logdir}"):
        _draw(parser, args, output)
    return output


def _draw(parser: argparse.ArgumentParser, args: argparse.Namespace, output: str) -> None:
    """The figure of ``plot`` (or of ``plot --history``) into ``output``."""
    if not args.history:
        plot_run(args.logdir, output, args.layers)
    else:
        fires = read_fires(args.logdir)
        if not fires:
            parser.exit(2, f"layer-grad-norms plot --history: {args.logdir}: no fire of the trigger with a flight "
                        "recorder (trigger.history) is recorded there\n")
        plot_spike_history(fires, localise_all(fires), output)


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


def _check_out(parser: argparse.ArgumentParser, out: str) -> None:
    """The demo's ``--out``: a directory, or a path to make one at, in whose nearest existing folder a file can be
    written (tried, not read from the mode bits, which root ignores and a read-only mount overrides)."""
    if os.path.exists(out) and not os.path.isdir(out):
        parser.error(f"--out {out}: a file, not a directory")
    existing = os.path.abspath(out)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        parser.error(f"--out {out}: {existing} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        parser.error(f"--out {out}: cannot write in {existing} ({err.strerror})")


def run_demo_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every option is checked here, before any rank is launched."""
    _check_out(parser, args.out)
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
