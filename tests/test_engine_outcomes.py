"""tests/engine/conftest.py writes each engine test's outcome to the work dir when it ends, so
a run cut short (before pytest's summary) still names its failures."""
import json
import os

pytest_plugins = "pytester"
ENGINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine")


def test_each_finished_or_failed_test_leaves_its_outcome(pytester, tmp_path):
    pytester.makeconftest(f"""
import importlib.util, sys
sys.path.insert(0, {ENGINE!r})
spec = importlib.util.spec_from_file_location("engine_conftest", {ENGINE + '/conftest.py'!r})
engine_conftest = importlib.util.module_from_spec(spec)
spec.loader.exec_module(engine_conftest)
pytest_runtest_makereport = engine_conftest.pytest_runtest_makereport

def pytest_addoption(parser):
    parser.addoption("--engine-work-dir")
""")
    pytester.makepyfile(test_some="""
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("no engine")

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "the engine's answer"

def test_setup_fails(broken):
    pass

@pytest.mark.skip(reason="needs 2 GPUs")
def test_skipped():
    pass
""")
    work = tmp_path / "work"
    pytester.runpytest("-p", "no:cacheprovider", f"--engine-work-dir={work}").assert_outcomes(
        passed=1, failed=1, errors=1, skipped=1)
    outcomes = {o["test"].split("::")[1]: o for o in
                (json.loads(p.read_text()) for p in (work / "outcomes").glob("*.json"))}
    assert set(outcomes) == {"test_passes", "test_fails", "test_setup_fails"}  # no skips
    assert outcomes["test_passes"]["outcome"] == "passed" and not outcomes["test_passes"]["error"]
    assert outcomes["test_fails"]["outcome"] == "failed"
    assert "the engine's answer" in outcomes["test_fails"]["error"]
    assert outcomes["test_setup_fails"]["when"] == "setup"
    assert "no engine" in outcomes["test_setup_fails"]["error"]
