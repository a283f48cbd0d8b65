"""``layer-grad-norms megatron-e2e``: train each set-up with the fork's own ``pretrain_gpt.py``, check it,
and write ``OUT/summary.json``, ``OUT/summary.md`` and, per set-up, its ds_config, command, full stdout, a
log excerpt and ``checks.json``."""

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from .launch import REPO_ROOT, build_data, run_setup
from .setups import SETUPS
from .verdict import check_run, log_excerpt

PATCHES = REPO_ROOT / "megatron_integration" / "patches"


@dataclass
class E2EOptions:
    fork: str
    setups: tuple = tuple(SETUPS)
    out: str = "runs/megatron-e2e"
    python: str = sys.executable
    train_iters: int = 30
    layers: str = "all"
    timeout: float = 1200
    apply_patch: Optional[str] = None
    """``microsoft`` or ``bigscience``: ``git apply`` that patch to the fork first (unless already applied)."""


def run_e2e(options: E2EOptions) -> Dict[str, Any]:
    fork, out = Path(options.fork).resolve(), Path(options.out).resolve()
    if options.apply_patch:
        apply_patch(fork, options.apply_patch)
    if "log_layer_grad_norms" not in (fork / "megatron" / "training.py").read_text():
        raise RuntimeError(f"{fork}: megatron/training.py does not call log_layer_grad_norms; apply the patch "
                           f"(--apply-patch microsoft|bigscience, or git apply {PATCHES}/<fork>.patch)")
    summary = {"fork": str(fork), "fork_commit": fork_commit(fork), "deepspeed": _version(options.python, "deepspeed"),
               "torch": _version(options.python, "torch"), "python": options.python,
               "train_iters": options.train_iters, "layers": options.layers, "setups": {}}
    data_path = build_data(fork, out / "data", options.python)
    for name in options.setups:
        setup, setup_out = SETUPS[name], out / name
        print(f"[megatron-e2e] {name}: {setup.description}", flush=True)
        returncode = run_setup(setup, fork, data_path, setup_out, options.python, options.train_iters,
                               options.layers, options.timeout)
        stdout = (setup_out / "stdout.log").read_text(errors="replace")
        (setup_out / "log_excerpt.txt").write_text(log_excerpt(stdout, failed=returncode != 0))
        result = {"description": setup.description, "ds_config": setup.ds_config(), "fork_flags": setup.fork_flags(),
                  **check_run(stdout, str(setup_out / "tensorboard"), returncode, options.train_iters,
                              setup.optimizer, setup.rss_against)}
        (setup_out / "checks.json").write_text(json.dumps(result, indent=2) + "\n")
        summary["setups"][name] = result
        print(f"[megatron-e2e] {name}: {'passed' if result['passed'] else 'FAILED'}", flush=True)
    summary["passed"] = all(result["passed"] for result in summary["setups"].values())
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(summary_markdown(summary))
    return summary


def apply_patch(fork: Path, which: str) -> None:
    patch = str(PATCHES / f"{which}.patch")
    if subprocess.run(["git", "apply", "--reverse", "--check", patch], cwd=fork, capture_output=True).returncode == 0:
        return  # applied already
    subprocess.run(["git", "apply", patch], cwd=fork, check=True)


def fork_commit(fork: Path) -> str:
    result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=fork, capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else "unknown (not a git checkout)"


def _version(python: str, package: str) -> str:
    script = f"import importlib.metadata as m; print(m.version({package!r}))"
    result = subprocess.run([python, "-c", script], capture_output=True, text=True)
    return result.stdout.strip() or "not installed"


def summary_markdown(summary: Dict[str, Any]) -> str:
    lines = [f"# Megatron-DeepSpeed end to end: {summary['fork']}", "",
             f"fork commit `{summary['fork_commit']}`, DeepSpeed {summary['deepspeed']}, torch {summary['torch']}, "
             f"{summary['train_iters']} iterations, `--layer-grad-norms-layers {summary['layers']}`", "",
             "| set-up | result | worst relative error, root-sum-square vs grad norm (the fork's, or the reference) "
             "| shims |",
             "| --- | --- | --- | --- |"]
    for name, result in summary["setups"].items():
        worst = result["worst_relative_error"]
        lines.append(f"| {name}: {result['description']} | {'passed' if result['passed'] else 'FAILED'} | "
                     f"{'-' if worst is None else f'{worst:.2e}'} | {'; '.join(result['shims']) or 'none'} |")
    for name, result in summary["setups"].items():
        lines += ["", f"## {name}", ""]
        lines += [f"- {'ok' if check['ok'] else 'FAILED'}: {check_name}: {check['detail']}"
                  for check_name, check in result["checks"].items()]
        lines += ["", "```"] + _last(result["log_lines"]) + ["```"]
    return "\n".join(lines) + "\n"


def _last(log_lines: List[str]) -> List[str]:
    return log_lines[-1:] if log_lines else ["(no log line with the per-layer field)"]
