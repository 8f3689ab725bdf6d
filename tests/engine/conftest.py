"""Fixtures of the engine checks; at the session's end (on xdist's controller, or without
xdist) with ``--results-dir DIR``, the result files of every row in the work dir. Each test's
outcome is written to the work dir as it ends (``outcomes/``), so a run cut short still says
which tests failed and why."""

import json
import os
import re
import uuid
from pathlib import Path

import pytest

import engines
import results
import rows


def pytest_configure(config):
    # before xdist starts its workers, which inherit it: one session, one token
    os.environ.setdefault(engines.SESSION_VAR, uuid.uuid4().hex)


@pytest.fixture
def record(request):
    """``record(kind, key, runs, **judged)``: this test's row (rows.py), replacing its last."""
    command = results.pytest_command(request.config)

    def write(kind: str, key: tuple, runs: list[dict], **judged) -> None:
        row = {"test": request.node.nodeid, "kind": kind, "key": list(key),
               "git_rev": results.git_rev(), "command": command,
               "session": os.environ.get(engines.SESSION_VAR),
               "runs": [{k: r.get(k) for k in ("model", "variant", "config", "git_rev",
                                               "shared_gpus", "mps")} for r in runs], **judged}
        name = _file_name(row["test"]) + ".json"
        path = Path(request.config.getoption("--engine-work-dir"), "rows", name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(json.dumps(row))
        os.replace(path.with_suffix(".tmp"), path)
    return write


def _file_name(nodeid: str) -> str:
    return re.sub(r"[^\w.-]+", "_", nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """``outcomes/<test>.json`` in the work dir when a test's call ends or a phase fails: its
    outcome, seconds and error text."""
    report = (yield).get_result()
    if report.when != "call" and not report.failed:
        return
    path = Path(item.config.getoption("--engine-work-dir"), "outcomes",
                _file_name(report.nodeid) + ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"test": report.nodeid, "when": report.when,
                                "outcome": report.outcome, "seconds": round(report.duration, 1),
                                "error": str(report.longrepr)[-4000:] if report.failed else None}))


def pytest_sessionfinish(session):
    config, out = session.config, session.config.getoption("--results-dir")
    if out and not hasattr(config, "workerinput"):
        for path in rows.write_results(config.getoption("--engine-work-dir"), out,
                                       os.environ.get(engines.SESSION_VAR)):
            print(f"wrote {path}")
