"""What each rank runs in the ZeRO-3 tests: zero_workers' training cases, set-ups that must be refused at
initialize, and the step cost with and without the statistics.
"""

import time
from typing import Any, Dict

import torch

from megatron_integration.tiny_gpt import TinyGPT, TinyGPTConfig, synthetic_batch
from zero_workers import DEFAULT_CASE, ds_config, run_cases


def refusal(overrides: Dict[str, Any]) -> str:
    """The error ``deepspeed.initialize`` raises for a ZeRO-3 set-up (empty if it raises none)."""
    import deepspeed

    case = {**DEFAULT_CASE, "stage": 3, **overrides}
    model = TinyGPT(TinyGPTConfig(num_layers=case["layers"]))
    try:
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                          config=ds_config(case, enabled=True))
    except Exception as err:  # the refusal under test, or a failure the test reports
        return f"{type(err).__name__}: {err}"
    engine.destroy()
    return ""


def run_all(cases: Dict[str, Dict[str, Any]], refused: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Every training case (``zero_workers.run_cases``), then every set-up expected to be refused."""
    return {"cases": run_cases(cases), "refused": {name: refusal(case) for name, case in refused.items()}}


def step_cost(steps: int, num_layers: int = 8, hidden: int = 256) -> Dict[str, float]:
    """Seconds per ZeRO-3 step with the statistics on, then off (``set_layer_grad_norms``), in one run."""
    import deepspeed

    import deepspeed_patch

    deepspeed_patch.install()
    config = TinyGPTConfig(num_layers=num_layers, hidden=hidden)
    model = TinyGPT(config)
    case = {**DEFAULT_CASE, "stage": 3, "clip": 1.0}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                                      config=ds_config(case, enabled=True))
    seconds = {}
    for enabled in (True, False, True, False):
        engine.set_layer_grad_norms(enabled=enabled)
        start = time.perf_counter()
        for step in range(steps):
            engine.backward(engine(synthetic_batch(config, 2, seed=step)))
            engine.step()
        seconds.setdefault(enabled, []).append((time.perf_counter() - start) / steps)
    engine.destroy()
    return {"on": min(seconds[True]), "off": min(seconds[False])}
