"""What ``deepspeed_tests`` adds to every process of a DeepSpeed test run: the feature-on block, and a log.

``deepspeed_tests`` puts this directory first on ``PYTHONPATH``; Python imports ``sitecustomize`` at
the start of every interpreter, so this also reaches the processes DeepSpeed's ``DistributedTest``
starts (forkserver, spawn), which a pytest conftest would not.

- ``LAYER_GRAD_NORMS_SITE_LOG`` (a folder): each process appends JSON lines to ``<folder>/<pid>.jsonl``:
  every exception ``deepspeed.initialize`` raises, with the test that was running
  (``PYTEST_CURRENT_TEST``). Several DeepSpeed tests turn such an exception into a skip
  ("Could not initialize deepspeed"); the log keeps what it was.
- ``LAYER_GRAD_NORMS_INJECT`` (a JSON object): ``DeepSpeedConfig._initialize_params`` gets it as the
  ``layer_grad_norms`` block whenever the config has none of its own (only the copy DeepSpeed reads
  changes, not the user's dict). Each config is logged: which ``config.py`` read it, whether an
  attribute of the config named ``*layer_grad_norms*`` then says ``enabled`` (the patched reader saw
  the block), and the error, when reading raised one.

Without these variables this module does nothing. Standalone: this project's package is not
importable in those processes.
"""

import functools
import importlib.abc
import importlib.util
import json
import os
import sys

INJECT_ENV = "LAYER_GRAD_NORMS_INJECT"
LOG_ENV = "LAYER_GRAD_NORMS_SITE_LOG"
BLOCK_KEY = "layer_grad_norms"
ERROR_CHARS = 500


def _log(record):
    folder = os.environ.get(LOG_ENV)
    if not folder:
        return
    record = {**record, "test": os.environ.get("PYTEST_CURRENT_TEST")}
    with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")


def _error(err):
    return f"{type(err).__name__}: {err}"[:ERROR_CHARS]


def _enabled_seen(config):
    """Whether the config object now holds an enabled ``layer_grad_norms`` setting."""
    return any(
        getattr(value, "enabled", None) is True for name, value in vars(config).items() if BLOCK_KEY in name.lower())


def _log_initialize_errors(module):
    """``deepspeed.initialize`` that logs what it raises."""
    original = getattr(module, "initialize", None)
    if original is None:
        return

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except Exception as err:
            _log({"event": "initialize raised", "error": _error(err)})
            raise

    module.initialize = initialize


def _inject_block(module):
    """``DeepSpeedConfig._initialize_params`` that reads the block when the config has none."""
    block = json.loads(os.environ[INJECT_ENV])
    config_class = module.DeepSpeedConfig
    original = getattr(config_class, "_initialize_params", None)
    if original is None:
        _log({"event": "no DeepSpeedConfig._initialize_params", "config_file": module.__file__})
        return

    @functools.wraps(original)
    def initialize_params(self, param_dict, *args, **kwargs):
        injected = BLOCK_KEY not in param_dict
        if injected:
            param_dict = {**param_dict, BLOCK_KEY: dict(block)}
        record = {"event": "injected" if injected else "own block kept", "config_file": module.__file__}
        try:
            return original(self, param_dict, *args, **kwargs)
        except Exception as err:
            record["raised"] = _error(err)
            raise
        finally:
            _log({**record, "enabled_seen": _enabled_seen(self)})

    config_class._initialize_params = initialize_params


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the modules of ``patches`` with the other finders, and patches each once it has run."""

    def __init__(self, patches):
        self.patches = dict(patches)
        self.loaders = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.patches or fullname in self.loaders:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        self.loaders[fullname] = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.loaders[spec.name].create_module(spec)

    def exec_module(self, module):
        loader = self.loaders[module.__name__]
        module.__loader__ = module.__spec__.loader = loader  # as if imported without this finder
        loader.exec_module(module)
        self.patches[module.__name__](module)


def _install():
    patches = {}
    if os.environ.get(LOG_ENV):
        patches["deepspeed"] = _log_initialize_errors
    if os.environ.get(INJECT_ENV):
        if not isinstance(json.loads(os.environ[INJECT_ENV]), dict):
            raise ValueError(f"{INJECT_ENV} must hold a JSON object, got {os.environ[INJECT_ENV]!r}")
        patches["deepspeed.runtime.config"] = _inject_block
    if patches:
        sys.meta_path.insert(0, _AfterImport(patches))


_install()
