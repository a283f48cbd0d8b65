"""What the upstream series up to patch 03 (the package's core and its failure latch) does that the package does
otherwise, run on a DeepSpeed carrying it (``PYTHONPATH``), one rank, ``deepspeed_patch`` not imported:

- a model whose layers lie in two stacks (an encoder's and a decoder's ``layers.N``) is refused at initialize, by
  name (the package keys them apart; PR 04 brings that upstream);
- a DeepSpeed monitor that raises is written once and then left alone, and the statistics and training go on (PR
  03's guard; the package guards its readers through ``publish.Consumer``, which PR 08 brings).

Prints one JSON line: what each case saw.
"""

import json
import os
import sys
import tempfile

import deepspeed
import torch

BLOCK = {"enabled": True}


def config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "layer_grad_norms": BLOCK,
            **extra}


def two_stacks_refusal() -> str:
    """The message of initialize's refusal of an encoder-decoder, or ``""`` if it was not refused."""
    model = torch.nn.Module()
    model.encoder = torch.nn.Module()
    model.encoder.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config())
    except Exception as error:  # the refusal's class is the patch's own
        return f"{type(error).__name__}: {error}"
    return ""


def failing_monitor(steps: int = 3) -> dict:
    """Steps trained with a CSV monitor whose ``write_events`` raises: how often it was called, the last result."""
    from deepspeed.runtime.layer_grad_norms.outputs.monitor import MonitorEvents

    model = torch.nn.Sequential()
    model.add_module("layers", torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)))
    monitor = {"enabled": True, "output_path": tempfile.mkdtemp(), "job_name": "core_patch"}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(csv_monitor=monitor))
    calls = []
    write_events = engine.monitor.write_events

    def raising(events):
        """The engine's own events go through; the statistics' fail, as a full disk would fail them."""
        if any("layer-grad-norms" in event[0] for event in events):
            calls.append(len(events))
            raise OSError("disk full")
        write_events(events)

    engine.monitor.write_events = raising
    for _ in range(steps):
        engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
        engine.step()
    result = engine.get_layer_grad_norms()
    return {"calls": len(calls), "events": calls[0] if calls else 0, "step": result and result["step"],
            "buckets": sorted(result["pre_clip"]) if result else [], "writer": MonitorEvents.__module__}


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    assert "deepspeed_patch" not in sys.modules
    print(json.dumps({"refusal": two_stacks_refusal(), "monitor": failing_monitor()}), flush=True)
    os._exit(0)  # past torch's exit-time gloo abort (upstream/bug_reports/gloo_exit_abort.md): the line is printed


if __name__ == "__main__":
    main()
