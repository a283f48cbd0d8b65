"""A pytest plugin that ``deepspeed_tests`` loads into DeepSpeed's own test runs (``-p lgn_outcomes``).

It writes one JSON line per test report to ``--lgn-outcomes FILE`` (node id, phase, outcome, the
failure or skip message), so that the harness reads outcomes per node id whatever pytest prints,
and, with ``--lgn-deselect-zero-stage 3``, deselects the parametrized cases of that ZeRO stage (a
``zero_stage`` or ``stage`` parameter) and the classes named for it (``TestZero3...``).

Standalone: imported by the test processes of a DeepSpeed checkout, where this project's package is
not importable.
"""

import json
import re
import sys

MESSAGE_CHARS = 6000
STAGE_PARAMETERS = ("zero_stage", "stage")


def pytest_addoption(parser):
    group = parser.getgroup("lgn_outcomes")
    group.addoption("--lgn-outcomes", default=None, help="write one JSON line per test report to this file")
    group.addoption("--lgn-deselect-zero-stage",
                    action="append",
                    type=int,
                    default=[],
                    help="deselect the cases of this ZeRO stage (repeatable)")


def _stage_of(item):
    """The ZeRO stage a test case is for, when a parameter or its class name says so; else None."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        for name in STAGE_PARAMETERS:
            if isinstance(callspec.params.get(name), int):
                return callspec.params[name]
    found = re.search(r"(?:Zero|ZeRO|Stage)(\d)", item.nodeid.split("::", 1)[-1])
    return int(found.group(1)) if found else None


def _message(report):
    if report.passed:
        return ""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    return report.longreprtext[-MESSAGE_CHARS:]


class OutcomeRecorder:
    """Appends the records to the ``--lgn-outcomes`` file as the reports arrive, so that a run cut
    short still leaves what it did."""

    def __init__(self, config):
        self.config = config
        self.path = config.getoption("lgn_outcomes")

    def write(self, record):
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")

    def pytest_collection_modifyitems(self, items):
        stages = set(self.config.getoption("lgn_deselect_zero_stage"))
        dropped = [item for item in items if stages and _stage_of(item) in stages]
        if not dropped:
            return
        self.config.hook.pytest_deselected(items=dropped)
        dropped_ids = {id(item) for item in dropped}
        items[:] = [item for item in items if id(item) not in dropped_ids]
        for item in dropped:
            self.write({"nodeid": item.nodeid, "when": "collect", "outcome": "deselected", "message": "",
                        "duration": 0.0})

    def pytest_runtest_logreport(self, report):
        outcome = report.outcome
        if "wasxfail" in vars(report):  # pytest marks an expected failure's report with this attribute
            outcome = "xfailed" if report.skipped else "xpassed"
        self.write({"nodeid": report.nodeid, "when": report.when, "outcome": outcome, "message": _message(report),
                    "duration": report.duration})

    def pytest_collectreport(self, report):
        if report.failed:
            self.write({"nodeid": report.nodeid, "when": "collect", "outcome": "failed", "message": _message(report),
                        "duration": 0.0})

    def pytest_sessionfinish(self, exitstatus):
        deepspeed = sys.modules.get("deepspeed")
        self.write({"session": True, "exitstatus": int(exitstatus), "deepspeed": getattr(deepspeed, "__file__", None)})


def pytest_configure(config):
    config.pluginmanager.register(OutcomeRecorder(config), "lgn_outcome_recorder")
