"""Apply the upstream patch to an installed DeepSpeed or a DeepSpeed checkout, check it, revert it.

The patch is built here, against the tree it goes into (``build.make_patch``), not read from a stored file.
``git apply`` does the work: it applies all hunks or none, and ``-R`` restores the files byte for
byte. The patch applied is kept in the patched tree (``RECORD``), so that ``check`` and ``revert`` use the
very patch ``apply`` used, whatever the package has become since. An installed package (no ``docs/`` beside
``deepspeed/``) gets the ``deepspeed/`` part only.
"""

import os
import subprocess
from typing import Optional

from .build import PATCH_RELEASES, UPSTREAM_PACKAGE, deepspeed_version, installed_deepspeed_root, make_patch

APPLIED, CLEAN, CONFLICT = "applied", "not applied", "conflicts"
COMMANDS = ("apply", "check", "revert")
RECORD = f"{UPSTREAM_PACKAGE}/applied.patch"  # the patch as applied, inside the package it added


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


def _git_apply(root: str, patch: str, *options: str) -> subprocess.CompletedProcess:
    """``git apply`` of the patch text ``patch`` in ``root`` (read from stdin)."""
    include = [] if os.path.isdir(os.path.join(root, "docs")) else ["--include=deepspeed/*"]
    # GIT_CEILING_DIRECTORIES: never treat a repository above root as the one to patch
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": os.path.dirname(root)}
    return subprocess.run(["git", "apply", *include, *options, "-"], input=patch, cwd=root, env=env,
                          capture_output=True, text=True)


def _recorded(root: str) -> Optional[str]:
    """The patch ``apply`` left in ``root``, when it is there and still reverts cleanly."""
    path = os.path.join(root, RECORD)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        patch = handle.read()
    return patch if _git_apply(root, patch, "--reverse", "--check").returncode == 0 else None


def _built(root: str) -> str:
    """The patch built against ``root``."""
    try:
        return make_patch(root)
    except (LookupError, ValueError, SyntaxError, OSError) as err:
        raise PatchError(f"cannot build the patch against {root}: {err}") from err


def state(root: str) -> str:
    """``APPLIED``, ``CLEAN`` (applies) or ``CONFLICT`` (neither: another release, or local edits)."""
    if _recorded(root) is not None:
        return APPLIED
    try:
        patch = _built(root)
    except PatchError:
        return CONFLICT
    return CLEAN if _git_apply(root, patch, "--check").returncode == 0 else CONFLICT


def _check_release(root: str) -> None:
    version = deepspeed_version(root)
    if version not in PATCH_RELEASES:
        raise PatchError(f"{root}: DeepSpeed {version}; the patch is for DeepSpeed {', '.join(PATCH_RELEASES)} "
                         f"(pip install deepspeed=={PATCH_RELEASES[-1]})")


def _run(root: str, patch: str, *options: str) -> None:
    result = _git_apply(root, patch, *options)
    if result.returncode != 0:
        raise PatchError(f"git apply {' '.join(options)} failed in {root}, nothing changed:\n{result.stderr}")


def _write_record(root: str, patch: Optional[str]) -> None:
    """Keep ``patch`` in ``root`` as the one applied; ``None``: take the record out."""
    path = os.path.join(root, RECORD)
    if patch is None:
        os.remove(path)
        return
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(patch)


def apply(root: str) -> str:
    """Build the patch against ``root`` and apply it; a no-op when it is already applied. Returns what was
    done."""
    _check_release(root)
    if _recorded(root) is not None:
        return f"already applied in {root}"
    patch = _built(root)
    _run(root, patch)  # all hunks or none; raises with git's description of a conflict
    _write_record(root, patch)
    return f"applied to {root}"


def revert(root: str) -> str:
    """Take the recorded patch out again, restoring the files byte for byte; a no-op when it is not applied."""
    patch = _recorded(root)
    if patch is None:
        if state(root) == CLEAN:
            return f"not applied in {root}"
        raise PatchError(f"{root}: no patch applied by `layer-grad-norms patch apply` reverts cleanly "
                         f"({RECORD} absent, or the files it patched were edited since); nothing changed")
    _write_record(root, None)
    try:
        _run(root, patch, "--reverse")
    except PatchError:
        _write_record(root, patch)
        raise
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
