"""Apply the upstream patch to an installed DeepSpeed or a DeepSpeed checkout, check it, revert it.

``git apply`` does the work: it applies all hunks or none, and ``-R`` restores the files byte for
byte. An installed package (no ``docs/`` beside ``deepspeed/``) gets the ``deepspeed/`` part only.
"""

import os
import subprocess
from typing import Optional

from .build import PATCH_FILE, PATCH_RELEASES, deepspeed_version, installed_deepspeed_root

APPLIED, CLEAN, CONFLICT = "applied", "not applied", "conflicts"
COMMANDS = ("apply", "check", "revert")


class PatchError(RuntimeError):
    """The patch cannot be applied or reverted here; nothing was changed."""


def deepspeed_root(path: Optional[str] = None) -> str:
    """The directory holding the ``deepspeed`` package: ``path`` itself, its parent when ``path`` is the
    package, or the installed DeepSpeed's."""
    if path is None:
        return installed_deepspeed_root()
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, "deepspeed", "__init__.py")):
        return path
    if os.path.basename(path) == "deepspeed" and os.path.isfile(os.path.join(path, "__init__.py")):
        return os.path.dirname(path)
    raise PatchError(f"--deepspeed {path}: no deepspeed package there (expected {path}/deepspeed/__init__.py)")


def _git_apply(root: str, *options: str) -> subprocess.CompletedProcess:
    include = [] if os.path.isdir(os.path.join(root, "docs")) else ["--include=deepspeed/*"]
    # GIT_CEILING_DIRECTORIES: never treat a repository above root as the one to patch
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": os.path.dirname(root)}
    return subprocess.run(["git", "apply", *include, *options, PATCH_FILE], cwd=root, env=env, capture_output=True,
                          text=True)


def state(root: str) -> str:
    """``APPLIED``, ``CLEAN`` (applies) or ``CONFLICT`` (neither: another release, or local edits)."""
    if _git_apply(root, "--reverse", "--check").returncode == 0:
        return APPLIED
    if _git_apply(root, "--check").returncode == 0:
        return CLEAN
    return CONFLICT


def _check_release(root: str) -> None:
    version = deepspeed_version(root)
    if version not in PATCH_RELEASES:
        raise PatchError(f"{root}: DeepSpeed {version}; the patch is for DeepSpeed {', '.join(PATCH_RELEASES)} "
                         f"(pip install deepspeed=={PATCH_RELEASES[-1]})")


def _run(root: str, *options: str) -> None:
    result = _git_apply(root, *options)
    if result.returncode != 0:
        raise PatchError(f"git apply {' '.join(options)} failed in {root}, nothing changed:\n{result.stderr}")


def apply(root: str) -> str:
    """Apply the patch; a no-op when it is already applied. Returns what was done."""
    _check_release(root)
    current = state(root)
    if current == APPLIED:
        return f"already applied in {root}"
    if current == CONFLICT:
        _run(root, "--check")  # raises with git's description of the conflict
    _run(root)
    return f"applied to {root}"


def revert(root: str) -> str:
    """Take the patch out again, restoring the files byte for byte; a no-op when it is not applied."""
    current = state(root)
    if current == CLEAN:
        return f"not applied in {root}"
    if current == CONFLICT:
        _run(root, "--reverse", "--check")
    _run(root, "--reverse")
    return f"reverted in {root}"


def run_patch_command(command: str, path: Optional[str]) -> int:
    """``layer-grad-norms patch apply|check|revert``; ``check`` exits 0 only when the patch is applied."""
    try:
        root = deepspeed_root(path)
        if command == "apply":
            print(apply(root))
        elif command == "revert":
            print(revert(root))
        else:
            current = state(root)
            print(f"{current} in {root} (DeepSpeed {deepspeed_version(root)})")
            return 0 if current == APPLIED else 1
    except PatchError as err:
        print(f"layer-grad-norms patch {command}: {err}")
        return 2
    return 0
