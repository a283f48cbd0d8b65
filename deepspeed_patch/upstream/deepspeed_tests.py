"""Run DeepSpeed's own unit tests on a checkout three ways and compare: unpatched, patched with the
feature off (the default), patched with the feature on (a ``layer_grad_norms`` block in every config).

    python -m deepspeed_patch.upstream.deepspeed_tests --deepspeed-checkout DIR [--patch FILE]
        [--work-dir DIR] [--selection FILE | --tests PATH_OR_NODE_ID ...] [--runs NAME ...]

The checkout is copied to ``<work-dir>/deepspeed``. The unpatched run goes first; then the patch
(given, or generated against the checkout with ``python -m deepspeed_patch.upstream.build``) is
applied to the copy for the two patched runs. One path for all three: DeepSpeed's JIT-built ops are
built once, and node ids and messages line up. Each run is one pytest session on whatever
accelerator DeepSpeed finds (the CPU one here), with ``pytest_site/`` first on ``PYTHONPATH``: a
plugin that records every outcome, and a ``sitecustomize`` that logs what ``deepspeed.initialize``
raises and, in the feature-on run, injects the block in every process. The comparison
(``comparison.md``, ``comparison.json``) gives the passed, failed, skipped and erroring node ids of
each run and every node whose outcome differs, with its messages.
"""

import argparse
import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .deepspeed_tests_report import compare, load_run, write_comparison

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
SITE = os.path.join(HERE, "pytest_site")
DEFAULT_SELECTION = os.path.join(HERE, "deepspeed_tests_selection.txt")
FEATURE_ON_BLOCK = {"enabled": True}
INJECT_ENV, SITE_LOG_ENV = "LAYER_GRAD_NORMS_INJECT", "LAYER_GRAD_NORMS_SITE_LOG"
SHM_LEFTOVERS = "/dev/shm/deepspeed_allreduce_buffer_*"


@dataclass(frozen=True)
class Run:
    name: str
    patched: bool
    inject: bool


RUNS = (Run("unpatched", False, False), Run("patched-off", True, False), Run("patched-on", True, True))
RUN_NAMES = tuple(run.name for run in RUNS)


class HarnessError(RuntimeError):
    """The trees or the runs could not be prepared; no comparison was written."""


# --- the trees ------------------------------------------------------------------------------------


def copy_checkout(checkout: str, destination: str) -> None:
    """A fresh copy of the checkout (without ``.git`` and bytecode)."""
    if os.path.exists(destination):
        shutil.rmtree(destination)
    shutil.copytree(checkout, destination, symlinks=True, ignore=shutil.ignore_patterns(".git", "__pycache__"))


def generate_patch(checkout: str, output: str) -> None:
    """The upstream patch written against ``checkout`` by this project's generator."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "deepspeed_patch.upstream.build", "--deepspeed", checkout, "-o", output]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise HarnessError(f"generating the patch against {checkout} failed:\n{result.stderr[-4000:]}")


def git_apply(tree: str, patch: str, *options: str) -> None:
    """``git apply`` the patch in ``tree`` (all hunks or none), or check that it applies."""
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": os.path.dirname(os.path.abspath(tree))}
    result = subprocess.run(["git", "apply", *options, os.path.abspath(patch)], cwd=tree, env=env,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise HarnessError(f"git apply {' '.join(options)} {patch} failed in {tree}:\n{result.stderr}")


def file_digest(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def checkout_identity(checkout: str) -> Dict[str, str]:
    """The checkout's version.txt and git commit, where it has them."""
    identity = {"path": os.path.abspath(checkout)}
    version = os.path.join(checkout, "version.txt")
    if os.path.isfile(version):
        with open(version, encoding="utf-8") as handle:
            identity["version"] = handle.read().strip()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True,
                          env={**os.environ, "GIT_CEILING_DIRECTORIES": os.path.dirname(os.path.abspath(checkout))})
    if head.returncode == 0:
        identity["commit"] = head.stdout.strip()
    return identity


# --- the selection --------------------------------------------------------------------------------


def read_selection(path: str) -> List[str]:
    """Paths and node ids, relative to the checkout, one a line; ``#`` starts a comment."""
    with open(path, encoding="utf-8") as handle:
        lines = [line.split("#", 1)[0].strip() for line in handle]
    return [line for line in lines if line]


def present_in(tree: str, selection: List[str]) -> List[str]:
    """The entries of ``selection`` whose file or folder exists in ``tree``."""
    return [entry for entry in selection if os.path.exists(os.path.join(tree, entry.split("::", 1)[0]))]


# --- one run --------------------------------------------------------------------------------------


def has_module(python: str, module: str) -> bool:
    result = subprocess.run([python, "-c", f"import {module}"], capture_output=True)
    return result.returncode == 0


def pytest_command(python: str, tree: str, tests: List[str], outcomes: str, options: argparse.Namespace) -> List[str]:
    """One pytest session over ``tests`` in ``tree``, with DeepSpeed's own pytest.ini and conftest."""
    command = [python, "-m", "pytest", "-c", os.path.join(tree, "tests", "pytest.ini"), "-p", "no:cacheprovider",
               "-p", "no:randomly", "-p", "lgn_outcomes", "--lgn-outcomes", outcomes, "-rA",
               "--continue-on-collection-errors"]
    for stage in options.deselect_zero_stage:
        command += ["--lgn-deselect-zero-stage", str(stage)]
    if options.test_timeout:
        # forked: a test that runs past its time ends its own process, not the session
        forked = has_module(python, "pytest_forked")
        if has_module(python, "pytest_timeout"):
            command += [f"--timeout={options.test_timeout}", f"--timeout-method={'thread' if forked else 'signal'}"]
        if forked:
            command.append("--forked")
    return command + options.pytest_args + tests


def run_environment(tree: str, work_dir: str, run: Run, site_log: str, options: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SITE, tree]), SITE_LOG_ENV: site_log,
           "TORCH_EXTENSIONS_DIR": os.path.join(work_dir, "torch_extensions")}
    env.pop(INJECT_ENV, None)
    if options.cpu_devices:
        # DeepSpeed's CPU accelerator counts NUMA nodes as devices, or takes LOCAL_SIZE (as its launcher sets
        # it); DistributedTest skips a test that wants more ranks than devices
        env["LOCAL_SIZE"] = str(options.cpu_devices)
    if options.test_timeout:
        env["DS_UNITTEST_TIMEOUT"] = str(options.test_timeout + 60)  # pytest-timeout ends a hung test first
    if run.inject:
        env[INJECT_ENV] = json.dumps(FEATURE_ON_BLOCK)
    return env


def mapped_files() -> set:
    """The files some process on this machine has mapped (those of others' running jobs among them)."""
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps, encoding="utf-8", errors="replace") as handle:
                mapped.update(line.split(maxsplit=5)[-1].strip() for line in handle if "/dev/shm/" in line)
        except OSError:
            continue  # the process ended, or is not ours to read
    return mapped


def remove_shm_leftovers(before: set) -> List[str]:
    """Delete the CPU all-reduce buffers that appeared during this run and that no process maps
    any more; those that were there before, or that another job still uses, stay."""
    left = sorted(set(glob.glob(SHM_LEFTOVERS)) - before - mapped_files())
    for path in left:
        os.remove(path)
    return left


def run_session(command: List[str], tree: str, env: dict, log, timeout: Optional[int]):
    """Run pytest in a process group of its own, so that a run past ``timeout`` ends with all the
    processes it started (DeepSpeed's forkserver and rank workers); returns its exit status or
    ``"timeout"``."""
    process = subprocess.Popen(command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return "timeout"


def run_tests(run: Run, work_dir: str, selection: List[str], patch_sha256: Optional[str],
              options: argparse.Namespace) -> None:
    """One pytest session; its outcomes, log and metadata go to ``runs/<name>/``."""
    tree = os.path.join(work_dir, "deepspeed")
    folder = os.path.join(work_dir, "runs", run.name)
    if os.path.exists(folder):
        shutil.rmtree(folder)
    site_log = os.path.join(folder, "site")
    os.makedirs(site_log)
    outcomes = os.path.join(folder, "outcomes.jsonl")
    tests = present_in(tree, selection)
    if not tests:  # pytest without paths would collect the whole tree
        raise HarnessError(f"none of the {len(selection)} selection entries exists in {tree} (paths are relative "
                           f"to the checkout, e.g. tests/unit/...): {selection[:3]}")
    command = pytest_command(options.python, tree, tests, outcomes, options)
    shm_before = set(glob.glob(SHM_LEFTOVERS))
    started = time.time()
    print(f"[{run.name}] {len(tests)} selection entries in {tree}", flush=True)
    env = run_environment(tree, work_dir, run, site_log, options)
    with open(os.path.join(folder, "pytest.log"), "w", encoding="utf-8") as log:
        returncode = run_session(command, tree, env, log, options.run_timeout)
    meta = {"run": run.name, "tree": tree, "patch_sha256": patch_sha256 if run.patched else None,
            "command": command, "selection": selection, "absent": sorted(set(selection) - set(tests)),
            "returncode": returncode, "wall_s": round(time.time() - started, 1),
            "shm_removed": remove_shm_leftovers(shm_before)}
    with open(os.path.join(folder, "meta.json"), "w", encoding="utf-8") as handle:
        json.dump(meta, handle, indent=1)
    print(f"[{run.name}] done in {meta['wall_s']} s, pytest exit {returncode}", flush=True)


# --- the whole comparison -------------------------------------------------------------------------


def prepare(options: argparse.Namespace) -> Tuple[str, str]:
    """The copy of the checkout, and the patch, checked to apply to it: ``(patch path, sha256)``."""
    os.makedirs(options.work_dir, exist_ok=True)
    patch = options.patch or os.path.join(options.work_dir, "layer_grad_norms.patch")
    if options.patch is None:
        generate_patch(options.deepspeed_checkout, patch)
    tree = os.path.join(options.work_dir, "deepspeed")
    copy_checkout(options.deepspeed_checkout, tree)
    git_apply(tree, patch, "--check")
    return patch, file_digest(patch)


def run_all(options: argparse.Namespace, selection: List[str], patch: str, patch_sha256: str) -> None:
    """The requested runs in order, the patch applied before the first patched one."""
    applied = False
    for run in RUNS:
        if run.name not in options.runs:
            continue
        if run.patched and not applied:
            git_apply(os.path.join(options.work_dir, "deepspeed"), patch)
            applied = True
        run_tests(run, options.work_dir, selection, patch_sha256, options)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed-checkout", required=True, help="a DeepSpeed source tree with its tests/")
    parser.add_argument("--patch", help="the patch to apply (default: generate it against the checkout)")
    parser.add_argument("--work-dir", default="deepspeed_tests_work",
                        help="where the tree copies, raw outputs and comparison go (default: %(default)s)")
    selection = parser.add_mutually_exclusive_group()
    selection.add_argument("--selection", default=DEFAULT_SELECTION, help="file of test paths / node ids")
    selection.add_argument("--tests", nargs="+", help="test paths / node ids, relative to the checkout")
    parser.add_argument("--runs", nargs="*", choices=RUN_NAMES, default=list(RUN_NAMES),
                        help="the runs to (re)do; the others are read from the work directory (none: compare only)")
    parser.add_argument("--deselect-zero-stage", type=int, action="append", default=None,
                        help="ZeRO stage whose cases are deselected (default: 3; 'none' via --all-stages)")
    parser.add_argument("--all-stages", action="store_true", help="keep every ZeRO stage's cases")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs pytest")
    parser.add_argument("--cpu-devices", type=int, default=2,
                        help="LOCAL_SIZE for DeepSpeed's CPU accelerator: tests of more ranks skip (0: leave it)")
    parser.add_argument("--test-timeout", type=int, default=900, help="seconds per test (0: DeepSpeed's own)")
    parser.add_argument("--run-timeout", type=int, default=None, help="seconds per run, all tests together")
    parser.add_argument("--label", default=None, help="a name for the checkout in the report (e.g. a commit)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: more pytest options (-k, -x)")
    options = parser.parse_args(argv)
    options.deselect_zero_stage = [] if options.all_stages else (options.deselect_zero_stage or [3])
    options.pytest_args = [arg for arg in options.pytest_args if arg != "--"]
    options.work_dir = os.path.abspath(options.work_dir)
    if os.sep in options.python:  # pytest runs in the tree; keep a venv's interpreter link as it is
        options.python = os.path.abspath(options.python)
    return options


def main(argv: Optional[List[str]] = None) -> int:
    options = parse_args(argv)
    selection = options.tests or read_selection(options.selection)
    try:
        patch, patch_sha256 = prepare(options)
        run_all(options, selection, patch, patch_sha256)
    except HarnessError as err:
        print(f"deepspeed_tests: {err}", file=sys.stderr)
        return 2
    loaded = {run.name: load_run(os.path.join(options.work_dir, "runs", run.name)) for run in RUNS}
    stale = [name for name, result in loaded.items()
             if result is not None and result.meta.get("patch_sha256") not in (None, patch_sha256)]
    if stale:
        print(f"deepspeed_tests: runs {stale} were made with another patch; rerun them (--runs {' '.join(stale)})",
              file=sys.stderr)
        return 2
    identity = checkout_identity(options.deepspeed_checkout)
    identity["label"] = options.label or identity.get("commit", os.path.basename(options.deepspeed_checkout))
    identity["patch_sha256"] = patch_sha256
    comparison = compare({name: result for name, result in loaded.items() if result is not None}, identity)
    written = write_comparison(comparison, options.work_dir)
    print("\n".join(f"wrote {path}" for path in written))
    return 0 if comparison["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
