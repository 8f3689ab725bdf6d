"""tests/gpu/conftest.py: ``--results-dir`` writes kernels.json with each test's outcome and
what it recorded (the padded rows' values among them), so one run of ``tests/gpu`` makes it."""
import json
import os

pytest_plugins = "pytester"
GPU = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu")


def test_kernels_json_keeps_what_each_test_recorded(pytester, tmp_path):
    pytester.makeconftest(f"""
import importlib.util
spec = importlib.util.spec_from_file_location("gpu_conftest", {GPU + '/conftest.py'!r})
gpu_conftest = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_conftest)
pytest_runtest_logreport = gpu_conftest.pytest_runtest_logreport
pytest_terminal_summary = gpu_conftest.pytest_terminal_summary

def pytest_addoption(parser):
    parser.addoption("--results-dir")
""")
    pytester.makepyfile(test_some="""
import pytest

@pytest.mark.parametrize("rank", [0, 1])
def test_padded(record_property, rank):
    record_property(f"rank {rank} padded out", {"nan": 0, "first": [0.0]})

def test_plain():
    pass

def test_wrong(record_property):
    record_property("seen", 1)
    assert False
""")
    pytester.runpytest(f"--results-dir={tmp_path}").assert_outcomes(passed=3, failed=1)
    doc = json.loads((tmp_path / "kernels.json").read_text())
    assert doc["recorded"] == {
        "test_some.py::test_padded[0]": {"rank 0 padded out": {"nan": 0, "first": [0.0]}},
        "test_some.py::test_padded[1]": {"rank 1 padded out": {"nan": 0, "first": [0.0]}},
        "test_some.py::test_wrong": {"seen": 1}}
    assert doc["failed"] == ["test_some.py::test_wrong"] and len(doc["tests"]) == 3
