"""What the layout test's rank runs: one measured ZeRO-2 step traced with ``sys.setprofile``, and the files of
this project whose functions it called (docs/layout.md names them)."""

import os
import sys
from typing import Any, Dict, List, Set

import torch

import deepspeed_patch
from megatron_integration.tiny_gpt import TinyGPT, TinyGPTConfig, synthetic_batch

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(deepspeed_patch.__file__)))
"""The checkout's root: a traced call counts when its code lives under ``deepspeed_patch/`` here."""

VARIANTS = {
    "plain": {},
    "optimizer_statistics_and_recorder": {
        "optimizer_statistics": ["param", "update", "exp_avg", "exp_avg_sq"],
        "trigger": {"history": 4},
    },
    "remedies": {
        "adaptive_clipping": {"enabled": True, "warmup_steps": 1},
        "skip_step": {"enabled": True, "window": 2},
    },
}
"""The block's extra keys for each traced step: the plain measured step, the same with the optimizer's statistics
and the flight recorder, and with both remedies acting (adaptive factors from the second step, skip_step judging
from the third): the files their paths add."""


def _project_file(filename: str) -> str:
    """``filename`` relative to the checkout if it is one of the package's files, else ''."""
    path = os.path.abspath(filename)
    package = os.path.join(PROJECT, "deepspeed_patch") + os.sep
    return os.path.relpath(path, PROJECT) if path.startswith(package) else ""


def traced_files(engine, batch: torch.Tensor) -> List[str]:
    """The package's files whose Python functions ran during one ``backward`` and ``step``."""
    seen: Set[str] = set()

    def profile(frame, event, arg) -> None:
        if event == "call":
            name = _project_file(frame.f_code.co_filename)
            if name:
                seen.add(name)

    sys.setprofile(profile)
    try:
        engine.backward(engine(batch))
        engine.step()
    finally:
        sys.setprofile(None)
    return sorted(seen)


def trace_measured_steps() -> Dict[str, Any]:
    """Each variant's traced files at its third step (the first two warm every cache up), and whether that
    step was measured."""
    import deepspeed

    deepspeed_patch.install()
    found = {}
    for name, extra in VARIANTS.items():
        torch.manual_seed(0)
        model = TinyGPT(TinyGPTConfig())
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 2},
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "steps_per_print": 10**9,
            "layer_grad_norms": {"enabled": True, "layers": "all", **extra},
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        batch = synthetic_batch(TinyGPTConfig(), 2, seed=0)
        for _ in range(2):
            engine.backward(engine(batch))
            engine.step()
        files = traced_files(engine, batch)
        result = engine.get_layer_grad_norms() or {}
        found[name] = {"files": files, "measured_step": result.get("step"),
                       "factors_applied": result.get("adaptive_clip") is not None, "skipped": result.get("skipped")}
        engine.destroy()
    return found
