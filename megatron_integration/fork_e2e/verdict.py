"""The checks of one fork run, each a pass or a failure with the evidence, and the excerpt of its log."""

import re
from typing import Any, Dict, List

from deepspeed_patch.outputs.tags import TAG_ROOT

from .checks import LogLine, TensorBoardData, log_line_errors, parse_log, read_tensorboard, root_sum_square_errors
from .entry import OPTIMIZER_LINE, SHIMS_LINE
from .reference import REFERENCE_LINE, parse_reference_norms
from .setups import NUM_LAYERS

RSS_REL_TOLERANCE = 1e-5  # TensorBoard stores float32: the sum of float32 squares, rounded, is within ~1e-7
COPY_REL_TOLERANCE = 1e-6  # replicas and tied copies of a gradient are equal, up to the reduction's rounding
EXCERPT_MARKERS = ("deepspeed info ...", "torch version ...", "Git info for Megatron", SHIMS_LINE, OPTIMIZER_LINE,
                   REFERENCE_LINE, "layer_grad_norms", " layer grad norm:", "Traceback", "Error", "error:")


def check_run(stdout: str, logdir: str, returncode: int, train_iters: int, optimizer: str,
              rss_against: str = "fork") -> Dict[str, Any]:
    """Every check of one run, the worst relative error of the root-sum-square, and what was read back.
    ``optimizer`` is the class ``deepspeed.initialize`` must return (the code path the set-up is about);
    ``rss_against`` what the root-sum-square must equal (``Setup.rss_against``)."""
    lines = parse_log(stdout)
    data = read_tensorboard(logdir)
    iterations = list(range(1, train_iters + 1))
    checks = {
        "exit status 0": (returncode == 0, f"exit status {returncode}"),
        "DeepSpeed optimizer": _optimizer_check(stdout, optimizer),
        "log line with the per-layer field": _log_field_check(lines),
        "log line agrees with TensorBoard": _none_is_good(log_line_errors(lines, data)),
        "layer-grad-norms scalars read back": _layers_check(data, iterations),
        "custom-scalars layout": _layout_check(data),
    }
    if rss_against == "fork":
        rss = root_sum_square_errors(data)
        checks["root-sum-square equals the fork's grad norm"] = _rss_check(rss, iterations)
    elif rss_against == "reference":
        references, spread = parse_reference_norms(stdout)
        rss = root_sum_square_errors(data, references)
        checks["reference norm: copies of a parameter agree"] = (
            bool(references) and spread <= COPY_REL_TOLERANCE,
            f"largest relative difference {spread:.1e} over {len(references)} iterations")
        checks["root-sum-square equals the reference norm (the fork logs none)"] = _rss_check(rss, iterations)
    else:
        raise ValueError(f"rss_against: {rss_against!r} is neither 'fork' nor 'reference'")
    worst = max((error for _, _, error in rss.values()), default=None)
    return {
        "passed": all(ok for ok, _ in checks.values()),
        "checks": {name: {"ok": ok, "detail": detail} for name, (ok, detail) in checks.items()},
        "worst_relative_error": worst,
        "root_sum_square": {step: {"root_sum_square": value, "fork_grad_norm": norm, "relative_error": error}
                            for step, (value, norm, error) in rss.items()},
        "shims": _shims(stdout),
        "log_lines": [line.text for line in lines],
        "layer_grad_norm_tags": data.layer_grad_norm_tags(),
        "custom_scalars_layouts": data.layouts,
    }


def log_excerpt(stdout: str, failed: bool, tail: int = 40) -> str:
    """The lines worth keeping: versions, shims, the optimizer, the flags, the per-layer log lines, errors;
    and the last lines of a failed run."""
    lines = stdout.splitlines()
    kept = [line for line in lines if any(marker in line for marker in EXCERPT_MARKERS)]
    return "\n".join(kept + (["--- last lines ---"] + lines[-tail:] if failed else [])) + "\n"


def _optimizer_check(stdout: str, expected: str):
    found = [line[len(OPTIMIZER_LINE):].strip() for line in stdout.splitlines() if line.startswith(OPTIMIZER_LINE)]
    return found[-1:] == [expected], f"{', '.join(found) or 'none reported'} (expected {expected})"


def _shims(stdout: str) -> List[str]:
    for line in stdout.splitlines():
        if line.startswith(SHIMS_LINE):
            return [shim.strip() for shim in line[len(SHIMS_LINE):].split(";") if shim.strip() != "none"]
    return []


def _none_is_good(errors: List[str]):
    return not errors, "; ".join(errors[:5]) or "every logged value matches"


def _log_field_check(lines: List[LogLine]):
    if not lines:
        return False, "no log line carries ' layer grad norm:'"
    wrong = [line.iteration for line in lines if sorted(line.layers) != list(range(NUM_LAYERS))]
    return not wrong, (f"iterations {[line.iteration for line in lines]}, layers 0..{NUM_LAYERS - 1}"
                       if not wrong else f"iterations {wrong} lack a layer")


def _layers_check(data: TensorBoardData, iterations: List[int]):
    layers = sorted(data.layer_norms)
    steps = {layer: sorted(series) for layer, series in data.layer_norms.items()}
    ok = layers == list(range(NUM_LAYERS)) and all(value == iterations for value in steps.values())
    return ok, f"layers {layers}, steps {sorted({tuple(value) for value in steps.values()})}"


def _layout_check(data: TensorBoardData):
    tags = data.tags()
    charts = {f"{category} / {chart}": regexes for layout in data.layouts for category, charts in layout.items()
              if TAG_ROOT in category for chart, regexes in charts.items()}
    empty = [name for name, regexes in charts.items()
             if not any(re.search(regex, tag) for regex in regexes for tag in tags)]
    return bool(charts) and not empty, (f"{len(charts)} charts, every one matching a written tag" if not empty
                                        else f"charts matching no tag: {empty}" if charts else "no layout")


def _rss_check(rss: Dict[int, tuple], iterations: List[int]):
    if sorted(rss) != iterations:
        return False, f"compared at steps {sorted(rss)}, expected {iterations[0]}..{iterations[-1]}"
    worst = max(error for _, _, error in rss.values())
    return worst <= RSS_REL_TOLERANCE, f"worst relative error {worst:.2e} over {len(rss)} iterations"
