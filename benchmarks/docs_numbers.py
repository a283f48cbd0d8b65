"""The numbers and figures the docs quote, from the demo runs that give them.

    python benchmarks/docs_numbers.py [--out runs/docs] [--figures docs]

Runs the demo four ways (Pre-LN and Post-LN with every layer, ``--spike 150:3`` and
``--lr-spike 100``, 200 steps each; a few minutes on 2 cores), writes ``OUT/docs_numbers.json``: each run's
numbers, and ``quotes``, the passages of each doc page that state them, as the docs must read. With ``--figures``
it also copies the figures the docs show into that directory (``docs``). ``tests/test_docs_numbers.py`` runs it
and checks that every quote is in its page (whitespace aside: the docs wrap their lines). The TensorBoard
screenshot, ``docs/demo_tensorboard.png``, is drawn by ``tests/browser.py`` (it needs Chromium).
"""

import argparse
import json
import os
import re
import shutil
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_integration.demo import DemoOptions, run_demo  # noqa: E402
from megatron_integration.report import summarize_source  # noqa: E402

SPIKE, LR_SPIKE = (150, 3), 100
RUNS = {
    "preln": dict(layers="all"),  # every layer: the figure's depth profile; the quoted layers are among them
    "postln": dict(arch="postln", layers="all"),
    "spike": dict(spike=SPIKE),
    "lr_spike": dict(lr_spike=LR_SPIKE),
}
"""Each run's options beyond the demo's defaults (12 layers, hidden 64, 200 steps, 2 ranks, ZeRO-2)."""
FIGURES = {"preln/layer_grad_norms.png": "demo_layer_grad_norms.png", "spike/spike_history.png": "spike_history.png",
           "spike/layer_grad_norms.png": "spike_layer_grad_norms.png"}
"""A run's figure, and its name in the docs."""


def run_all(out: str) -> Dict[str, Dict]:
    """Every run's report summary (``report --json``), from its TensorBoard log, and from the dump with a spike."""
    summaries = {}
    for name, options in RUNS.items():
        run_out = os.path.join(out, name)
        run_demo(DemoOptions(out=run_out, **options))
        summaries[name] = summarize_source(os.path.join(run_out, "tensorboard"))
        if "spike" in name:
            summaries[name]["spikes"] = summarize_source(os.path.join(run_out, "layer_grad_norms.jsonl"))["spikes"]
    return summaries


def numbers(summaries: Dict[str, Dict]) -> Dict[str, object]:
    """What the docs state, from the summaries (medians of the second half of the run)."""
    pre, post = summaries["preln"], summaries["postln"]
    spike, lr_spike = summaries["spike"]["spikes"][0], summaries["lr_spike"]["spikes"][0]  # the first fire of each
    followed = [rise["rise_at_fire"] for layer, rise in lr_spike["layers"].items() if isinstance(layer, int)]
    return {
        "preln_first": pre["median_norm"][0], "preln_last": pre["median_norm"][11],
        "preln_ratio": pre["early_late_ratio"],
        "postln_ratio": post["early_late_ratio"], "postln_layer3": post["median_norm"][3],
        "postln_last": post["median_norm"][11],
        "spike_answer": spike["answer"], "lr_spike_answer": lr_spike["answer"],
        "lr_spike_rise": [min(followed), max(followed)],
    }


def quotes(found: Dict[str, object]) -> Dict[str, List[str]]:
    """The passages each page must hold, whitespace aside."""
    normformer = (f"from {found['preln_first']:.2f} at layer 0 to {found['preln_last']:.2f} at layer 11, so the "
                  f"first two layers get {found['preln_ratio']:.2f}x the gradient of the last two")
    rose_most = re.search(r"layer \d+ rose most, \S+ its level before the recorded steps at step \d+",
                          found["spike_answer"])[0]
    lr_answer = found["lr_spike_answer"].split("; first above")[0]
    lr_low, lr_high = found["lr_spike_rise"]
    return {
        "README.md": [normformer, rose_most.rsplit(" at step", 1)[0],
                      re.search(r"update of every layer \(\d+ of \d+\) rose first, step \d+", lr_answer)[0]],
        "docs/demo.md": [normformer, f"(ratio {found['postln_ratio']:.2f})",
                         f"flat beyond layer 3 ({found['postln_layer3']:.2f} to {found['postln_last']:.2f})",
                         f"gradients rise {lr_low:.0f}-{lr_high:.0f}x in every layer"],
        "docs/spikes.md": [re.search(r"\(grad norm .*?\)", found["spike_answer"])[0], rose_most, lr_answer],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/docs", help="the runs' directory, and docs_numbers.json")
    parser.add_argument("--figures", help="copy the figures the docs show into this directory (docs)")
    args = parser.parse_args()
    found = numbers(run_all(args.out))
    result = {"numbers": found, "quotes": quotes(found)}
    with open(os.path.join(args.out, "docs_numbers.json"), "w") as out:
        json.dump(result, out, indent=2)
    if args.figures:
        for source, name in FIGURES.items():
            shutil.copyfile(os.path.join(args.out, source), os.path.join(args.figures, name))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
