"""Read the outcomes of ``deepspeed_tests`` runs and write their comparison (markdown and JSON).

Each run folder holds ``outcomes.jsonl`` (one line per pytest report, from ``pytest_site/lgn_outcomes.py``),
``meta.json`` (the command, wall time, exit status) and ``site/`` (what ``pytest_site/sitecustomize.py``
logged in each process: the errors ``deepspeed.initialize`` raised, the feature-on injections).
"""

import collections
import glob
import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

FAILING = ("failed", "error")
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "deselected", "not finished", "not run")
CONFIG_KEY = "layer_grad_norms"
# a frame in the patch's package, or in a file the patch changed, that raised; fake trees name the key only
PATCH_MARK = re.compile(r"deepspeed/runtime/layer_grad_norms/|^E\s.*\blayer_grad_norms\b(?!_)", re.MULTILINE)
MESSAGE_CHARS_IN_MARKDOWN = 1500


@dataclass
class NodeOutcome:
    outcome: str
    message: str = ""
    duration: float = 0.0


@dataclass
class RunResult:
    meta: dict
    outcomes: Dict[str, NodeOutcome]
    session: Optional[dict]
    """The record the session wrote at its end; None when it did not end (killed, timed out)."""
    site: dict = field(default_factory=dict)
    initialize_errors: Dict[str, List[str]] = field(default_factory=dict)
    """The errors ``deepspeed.initialize`` raised, by the node id of the test that was running."""


def _records(path: str) -> List[dict]:
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def final_outcomes(records: List[dict]) -> Dict[str, NodeOutcome]:
    """One outcome per node id from its setup, call and teardown reports (a failing setup or
    teardown is an ``error``, as pytest counts it; a node that set up and never reported its call
    did ``not finish``)."""
    outcomes: Dict[str, NodeOutcome] = {}
    for record in records:
        if record.get("session"):
            continue
        nodeid, when, outcome = record["nodeid"], record["when"], record["outcome"]
        current = outcomes.get(nodeid)
        duration = record["duration"] + (current.duration if current else 0.0)
        if when == "collect":
            outcomes[nodeid] = NodeOutcome("error" if outcome == "failed" else outcome, record["message"])
        elif when == "setup":
            final = {"passed": "not finished", "failed": "error"}.get(outcome, outcome)
            outcomes[nodeid] = NodeOutcome(final, record["message"], duration)
        elif when == "teardown":
            if outcome == "failed" and current is not None and current.outcome not in FAILING:
                outcomes[nodeid] = NodeOutcome("error", record["message"], duration)
            elif current is not None:
                current.duration = duration
        else:  # "call", or pytest-forked's report of a crashed test process
            outcomes[nodeid] = NodeOutcome(outcome, record["message"], duration)
    return outcomes


def _site_records(folder: str) -> List[dict]:
    return [record for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))) for record in _records(path)]


def site_summary(records: List[dict]) -> dict:
    """What ``sitecustomize`` logged: configs that got the block, whether the patched reader enabled
    the feature, the config modules that read it, and the errors of ``deepspeed.initialize``."""
    configs = [record for record in records if "config_file" in record]
    errors = collections.Counter(record["error"].splitlines()[0] for record in records
                                 if record["event"] == "initialize raised")
    return {
        "events": dict(collections.Counter(record["event"] for record in configs)),
        "enabled_seen": sum(1 for record in configs if record.get("enabled_seen")),
        "config_files": sorted({record["config_file"] for record in configs}),
        "initialize_errors": dict(errors.most_common()),
    }


def initialize_errors_by_test(records: List[dict]) -> Dict[str, List[str]]:
    found = collections.defaultdict(list)
    for record in records:
        if record["event"] == "initialize raised" and record.get("test"):
            nodeid = record["test"].rsplit(" (", 1)[0]
            if record["error"] not in found[nodeid]:
                found[nodeid].append(record["error"])
    return dict(found)


def load_run(folder: str) -> Optional[RunResult]:
    """A run's results, or None when it was never made."""
    meta_path = os.path.join(folder, "meta.json")
    if not os.path.isfile(meta_path):
        return None
    with open(meta_path, encoding="utf-8") as handle:
        meta = json.load(handle)
    records = _records(os.path.join(folder, "outcomes.jsonl"))
    sessions = [record for record in records if record.get("session")]
    site = _site_records(os.path.join(folder, "site"))
    return RunResult(meta, final_outcomes(records), sessions[-1] if sessions else None, site_summary(site),
                     initialize_errors_by_test(site))


def key_line(message: str) -> str:
    """The line of a failure message that says what went wrong: the last ``E   ...`` line pytest
    prints, or the message's last line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line[1:].strip() for line in lines if re.match(r"^E\s", line)]
    return (errors[-1] if errors else lines[-1] if lines else "")[:300]


def _kind(outcomes: Dict[str, str], messages: Dict[str, str], raised: Dict[str, List[str]]) -> str:
    """A mechanical label of one difference; the explanation is for a person to write."""
    if outcomes.get("unpatched") == "not run" and all(value != "not run" for name, value in outcomes.items()
                                                      if name != "unpatched"):
        return "only in the patched tree"
    said = list(messages.values()) + [f"E {error}" for errors in raised.values() for error in errors]
    if any(PATCH_MARK.search(message) for message in said):
        return "error from layer_grad_norms"
    if any(value in ("not run", "not finished") for value in outcomes.values()):
        return "a run did not reach it"
    return "other"


def _run_problems(name: str, result: RunResult) -> List[str]:
    problems = []
    if result.session is None:
        problems.append(f"{name}: the pytest session did not end (exit {result.meta['returncode']})")
    elif not str(result.session.get("deepspeed") or "").startswith(result.meta["tree"] + os.sep):
        problems.append(f"{name}: deepspeed was imported from {result.session.get('deepspeed')}, "
                        f"not from {result.meta['tree']}")
    if name == "patched-on" and result.site.get("enabled_seen", 0) == 0:
        problems.append(f"{name}: no config came out of the patched reader with {CONFIG_KEY} enabled")
    return problems


def compare(runs: Dict[str, RunResult], identity: dict) -> dict:
    """Counts, node ids by outcome, skip reasons and every difference between the runs."""
    nodes = sorted({nodeid for result in runs.values() for nodeid in result.outcomes})
    summary, problems = {}, []
    for name, result in runs.items():
        by_outcome = collections.defaultdict(list)
        for nodeid, node in sorted(result.outcomes.items()):
            by_outcome[node.outcome].append(nodeid)
        skips = collections.Counter(key_line(node.message) for node in result.outcomes.values()
                                    if node.outcome == "skipped")
        summary[name] = {
            "counts": {outcome: len(by_outcome[outcome]) for outcome in OUTCOMES if by_outcome[outcome]},
            "nodes": dict(by_outcome),
            "skip_reasons": dict(skips.most_common()),
            "wall_s": result.meta["wall_s"],
            "returncode": result.meta["returncode"],
            "absent": result.meta["absent"],
            "deepspeed": (result.session or {}).get("deepspeed"),
            "site": result.site,
        }
        problems += _run_problems(name, result)
    differences, failing_everywhere = [], []
    for nodeid in nodes:
        found = {name: result.outcomes.get(nodeid) for name, result in runs.items()}
        outcomes = {name: node.outcome if node else "not run" for name, node in found.items()}
        messages = {name: node.message for name, node in found.items() if node and node.outcome in FAILING}
        if len(set(outcomes.values())) > 1:
            raised = {name: result.initialize_errors[nodeid] for name, result in runs.items()
                      if nodeid in result.initialize_errors}
            differences.append({"nodeid": nodeid, "outcomes": outcomes, "kind": _kind(outcomes, messages, raised),
                                "key_lines": {name: key_line(message) for name, message in messages.items()},
                                "messages": messages, "initialize_raised": raised})
        elif messages:
            failing_everywhere.append({"nodeid": nodeid, "outcome": next(iter(outcomes.values())),
                                       "key_line": key_line(next(iter(messages.values())))})
    return {"checkout": identity, "runs": summary, "differences": differences,
            "failing_in_every_run": failing_everywhere, "problems": problems, "valid": not problems}


# --- markdown -------------------------------------------------------------------------------------


def _counts_table(comparison: dict) -> List[str]:
    shown = [outcome for outcome in OUTCOMES
             if any(outcome in run["counts"] for run in comparison["runs"].values())]
    lines = ["| run | " + " | ".join(shown) + " | wall |", "| --- |" + " ---: |" * (len(shown) + 1)]
    for name, run in comparison["runs"].items():
        cells = [str(run["counts"].get(outcome, 0)) for outcome in shown]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {run['wall_s']:.0f} s |")
    return lines


def _difference_lines(comparison: dict, details: bool) -> List[str]:
    differences = comparison["differences"]
    if not differences:
        return ["No node id has a different outcome in any run."]
    names = list(comparison["runs"])
    lines = ["| node id | " + " | ".join(names) + " | kind | what the failing run says |",
             "| --- |" + " --- |" * (len(names) + 2)]
    for entry in differences:
        raised = {name: errors[-1].splitlines()[0] for name, errors in entry["initialize_raised"].items()}
        said = "; ".join(f"{name}: `{line}`" for name, line in {**raised, **entry["key_lines"]}.items())
        lines.append(f"| `{entry['nodeid']}` | " + " | ".join(entry["outcomes"][name] for name in names) +
                     f" | {entry['kind']} | {said} |")
    for entry in differences if details else []:
        for name, message in entry["messages"].items():
            lines += ["", f"<details><summary>{entry['nodeid']} ({name})</summary>", "", "```",
                      message[-MESSAGE_CHARS_IN_MARKDOWN:], "```", "</details>"]
    return lines


def markdown(comparison: dict, details: bool = True) -> str:
    """The comparison for people; ``details``: with each failing run's whole message."""
    checkout = comparison["checkout"]
    lines = ["# DeepSpeed's unit tests: unpatched, patched with the feature off, patched with it on", "",
             f"- Checkout: {checkout.get('label')} (version.txt {checkout.get('version', '?')}, "
             f"commit {checkout.get('commit', 'unknown')})", f"- Patch sha256: `{checkout.get('patch_sha256')}`"]
    lines += [f"- Problem: {problem}" for problem in comparison["problems"]]
    lines += ["", "## Counts", ""] + _counts_table(comparison)
    for name, run in comparison["runs"].items():
        if run["absent"]:
            lines.append(f"\n{name}: selection entries absent from the tree: " +
                         ", ".join(f"`{entry}`" for entry in run["absent"]))
        site = run["site"]
        if site["events"]:
            lines.append(f"\n{name}: configs that got the block: {site['events']}; {site['enabled_seen']} came out "
                         f"of the reader enabled.")
        if site["initialize_errors"]:
            lines.append(f"\n{name}: `deepspeed.initialize` raised: " + "; ".join(
                f"{count} x `{error}`" for error, count in site["initialize_errors"].items()))
    lines += ["", "## Differences", ""] + _difference_lines(comparison, details)
    lines += ["", "## Failing in every run (not a difference)", ""]
    lines += [f"- `{entry['nodeid']}` ({entry['outcome']}): `{entry['key_line']}`"
              for entry in comparison["failing_in_every_run"]] or ["None."]
    lines += ["", "## Skip reasons", ""]
    for name, run in comparison["runs"].items():
        reasons = "; ".join(f"{count} x `{reason}`" for reason, count in run["skip_reasons"].items())
        lines.append(f"- {name}: {reasons or 'none'}")
    return "\n".join(lines) + "\n"


def write_comparison(comparison: dict, folder: str) -> List[str]:
    """``comparison.json``, ``comparison.md`` and ``summary.md`` (without the whole messages) in
    ``folder``; returns their paths."""
    paths = [os.path.join(folder, name) for name in ("comparison.md", "summary.md", "comparison.json")]
    for path, text in zip(paths, (markdown(comparison), markdown(comparison, details=False),
                                  json.dumps(comparison, indent=1, default=asdict))):
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    return paths
