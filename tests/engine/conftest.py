"""Fixtures of the engine checks; at the session's end (on xdist's controller, or without
xdist) with ``--results-dir DIR``, the result files of every row in the work dir."""

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
                                               "shared_gpus")} for r in runs], **judged}
        name = re.sub(r"[^\w.-]+", "_", row["test"]) + ".json"
        path = Path(request.config.getoption("--engine-work-dir"), "rows", name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(json.dumps(row))
        os.replace(path.with_suffix(".tmp"), path)
    return write


def pytest_sessionfinish(session):
    config, out = session.config, session.config.getoption("--results-dir")
    if out and not hasattr(config, "workerinput"):
        for path in rows.write_results(config.getoption("--engine-work-dir"), out,
                                       os.environ.get(engines.SESSION_VAR)):
            print(f"wrote {path}")
