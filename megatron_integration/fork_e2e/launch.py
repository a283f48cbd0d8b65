"""Build the tiny data set with the fork's own tool, and launch the fork's ``pretrain_gpt.py`` with the
DeepSpeed launcher (``deepspeed --num_gpus 2`` or 8, on CPU ranks) through ``entry.py``."""

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import megatron_integration

from ..cpu_launch import free_port, relaunch_after_exit_abort, remove_shm_buffers
from .setups import VOCAB_SIZE, Setup, model_flags

REPO_ROOT = Path(megatron_integration.__file__).resolve().parent.parent
ENTRY = Path(__file__).resolve().parent / "entry.py"
DATA_NAME = "tiny"


def rank_environment(python: str) -> Dict[str, str]:
    """The environment of the launched ranks: this repository importable; ``python``'s directory first on
    ``PATH`` (the fork builds its dataset helpers with ``python3 -m pybind11 --includes`` from
    ``megatron/data/Makefile``, so ``python3`` must be the ranks' interpreter); and, for another interpreter
    than this one, a torch-extension cache of the ranks' own DeepSpeed installation (DeepSpeed JIT-builds
    ``deepspeed_shm_comm`` there; a build left by another release fails at ``init_distributed`` with "module
    'deepspeed_shm_comm' has no attribute ..."). Ranks of this interpreter keep the environment's folder
    (torch's default unless set), as every other launch of this installation does."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join(filter(None, [str(Path(python).parent), env.get("PATH")]))
    if "TORCH_EXTENSIONS_DIR" not in env and python != sys.executable:
        env["TORCH_EXTENSIONS_DIR"] = str(Path.home() / ".cache" / "torch_extensions" / extension_cache_name(python))
    return env


def extension_cache_name(python: str) -> str:
    """``deepspeed-<release>-<interpreter prefix hash>``: one JIT build per DeepSpeed installation (torch
    rebuilds when the include paths change, so two installations of one release would rebuild in turn)."""
    script = "import importlib.metadata as m, sys; print(m.version('deepspeed'), sys.prefix)"
    release, prefix = subprocess.run([python, "-c", script], check=True, capture_output=True,
                                     text=True).stdout.split(maxsplit=1)
    return f"deepspeed-{release}-{hashlib.sha1(prefix.strip().encode()).hexdigest()[:8]}"


def write_jsonl(path: Path, documents: int = 400, seed: int = 0) -> None:
    """Documents of 20 to 120 space-separated token ids below ``VOCAB_SIZE`` (the NullTokenizer's input)."""
    rng = random.Random(seed)
    with open(path, "w") as out:
        for _ in range(documents):
            tokens = (str(rng.randrange(VOCAB_SIZE)) for _ in range(rng.randint(20, 120)))
            out.write(json.dumps({"text": " ".join(tokens)}) + "\n")


def build_data(fork: Path, out: Path, python: str) -> Path:
    """The fork's ``tools/preprocess_data.py`` on a JSONL of token ids; returns the ``--data-path`` prefix."""
    out.mkdir(parents=True, exist_ok=True)
    prefix = out / DATA_NAME
    jsonl = out / f"{DATA_NAME}.jsonl"
    write_jsonl(jsonl)
    command = [python, "tools/preprocess_data.py", "--input", str(jsonl), "--output-prefix", str(prefix),
               "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB_SIZE), "--workers", "1",
               "--append-eod"]
    with open(out / "preprocess.log", "w") as log:
        subprocess.run(command, cwd=fork, env=rank_environment(python), stdout=log, stderr=subprocess.STDOUT,
                       check=True)
    return Path(f"{prefix}_text_document")


def launch_command(python: str, fork: Path, port: int, world_size: int, fork_args: List[str]) -> List[str]:
    """``deepspeed --num_gpus WORLD_SIZE --master_port PORT entry.py FORK/pretrain_gpt.py ARGS`` with ``python``'s
    DeepSpeed (the ``deepspeed`` script is this module's ``main``)."""
    return [python, "-m", "deepspeed.launcher.runner", "--num_gpus", str(world_size), "--master_port", str(port),
            str(ENTRY), str(fork / "pretrain_gpt.py")] + fork_args


def run_setup(setup: Setup, fork: Path, data_path: Path, out: Path, python: str, train_iters: int, layers: str,
              timeout: float) -> int:
    """Train ``setup``; its ds_config, full stdout and TensorBoard go into ``out``. Returns the exit status. A
    launch that ends in torch's gloo exit abort, its training done, is launched once more from an empty TensorBoard
    folder (``relaunch_after_exit_abort``)."""
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "ds_config.json"
    config_path.write_text(json.dumps(setup.ds_config(), indent=2) + "\n")
    fork_args = model_flags(train_iters, layers) + setup.fork_flags() + [
        "--data-path", str(data_path), "--tensorboard-dir", str(out / "tensorboard"),
        "--deepspeed", "--deepspeed_config", str(config_path)]
    return relaunch_after_exit_abort(lambda: _train(python, fork, setup.world_size, fork_args, out, timeout),
                                     lambda returncode: (returncode, (out / "stdout.log").read_text(errors="replace")),
                                     lambda message: print(message, flush=True),
                                     f"[megatron-e2e] {setup.name}",
                                     before_relaunch=lambda: shutil.rmtree(out / "tensorboard", ignore_errors=True))


def _train(python: str, fork: Path, world_size: int, fork_args: List[str], out: Path, timeout: float) -> int:
    """One launch, its command in ``out/command.txt`` and its output in ``out/stdout.log``; the exit status."""
    port = free_port()
    command = launch_command(python, fork, port, world_size, fork_args)
    (out / "command.txt").write_text(" ".join(command) + "\n")
    with open(out / "stdout.log", "w") as log:
        launcher = subprocess.Popen(command, cwd=fork, env=rank_environment(python), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return launcher.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return 124
        finally:
            if launcher.poll() is None:  # timed out or interrupted: the launcher and its ranks, nothing else
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
            remove_shm_buffers(port)
