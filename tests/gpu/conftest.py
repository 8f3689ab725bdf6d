"""With ``--results-dir DIR``, the session's outcomes go to ``DIR/kernels.json``: pass
counts per test function, the failed tests, the passed ones, what tests recorded with
``record_property`` (``recorded``, by test), and ``meta``."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "engine"))
import results  # noqa: E402

_OUTCOMES: dict[str, str] = {}
_RECORDED: dict[str, dict] = {}


def pytest_runtest_logreport(report):
    if report.when == "call" and report.user_properties:
        _RECORDED[report.nodeid] = dict(report.user_properties)
    if report.when == "call" or report.outcome != "passed":  # setup errors and skips too
        outcome = {"failed": "failed" if report.when == "call" else "error"}.get(
            report.outcome, report.outcome)
        _OUTCOMES.setdefault(report.nodeid, outcome)


def kernels_result(outcomes: dict[str, str], summary: str | None, meta: dict,
                   recorded: dict[str, dict] | None = None) -> dict:
    """kernels.json from test id -> outcome (passed, failed, error, skipped) and test id ->
    the values it recorded (``record_property``: name -> value)."""
    counts: dict[str, dict] = {}
    for test, outcome in outcomes.items():
        by_outcome = counts.setdefault(test.split("[")[0], {})
        by_outcome[outcome] = by_outcome.get(outcome, 0) + 1
    return {"meta": meta, "pytest_summary": summary, "counts": counts,
            "failed": [t for t, o in outcomes.items() if o in ("failed", "error")],
            "tests": [t for t, o in outcomes.items() if o == "passed"],
            **({"recorded": recorded} if recorded else {})}


def pytest_terminal_summary(terminalreporter, config):
    out = config.getoption("--results-dir")
    if not out or not _OUTCOMES:
        return
    stats = {k: len(v) for k, v in terminalreporter.stats.items() if k and k != "warnings"}
    summary = ", ".join(f"{n} {k}" for k, n in sorted(stats.items()))
    try:
        meta = results.meta()
    except Exception as exc:  # no GPU: recorded, not fatal
        meta = results.meta(host={"gpu": f"unavailable: {exc}"})
    path = results.write(out, "kernels.json", kernels_result(dict(_OUTCOMES), summary, meta,
                                                             dict(_RECORDED)))
    terminalreporter.write_line(f"wrote {path}")
