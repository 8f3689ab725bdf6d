"""scripts/engine_smoke.py without a GPU: the engine core it starts, and what ``repeat``
reports of two runs of a layout."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location(
    "engine_smoke", os.path.join(ROOT, "scripts", "engine_smoke.py"))
smoke = importlib.util.module_from_spec(spec)
spec.loader.exec_module(smoke)


class EngineBuilt(Exception):
    pass


def test_an_engine_runs_its_core_in_this_process(monkeypatch, tmp_path):
    """A core process of its own steps on the first request that arrives, so two runs of
    one generate call can batch the prompts differently; in-process it sees them all."""
    import vllm

    seen = {}

    def fake_llm(**kwargs):
        seen["var"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        raise EngineBuilt

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # restored after the test
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    monkeypatch.setattr(vllm, "LLM", fake_llm)
    with pytest.raises(EngineBuilt):
        smoke.run(str(tmp_path), "pcp2-dcp2", str(tmp_path / "out.json"))
    assert seen["var"] == "0"


def _raw(tokens: list[int], steps: int | None) -> dict:
    counts = None if steps is None else [{"steps": steps, "split_steps": 2}] * 2
    return {"greedy": [{"tokens": tokens, "top": [{str(t): -0.5} for t in tokens]}],
            "sampled": [[tokens]], "step_counts": counts}


def test_repeat_names_each_runs_steps_beside_its_differences(tmp_path):
    runs = {"a": {"pcp1": _raw([1, 2, 3], None), "pcp2-dcp2": _raw([1, 2, 3], 40)},
            "b": {"pcp1": _raw([1, 2, 3], None), "pcp2-dcp2": _raw([1, 5, 3], 42)}}
    for run, layouts in runs.items():
        (tmp_path / run).mkdir()
        for name, raw in layouts.items():
            (tmp_path / run / f"{name}.json").write_text(json.dumps(raw))
    out = tmp_path / "repeat.json"
    smoke.repeat(str(out), str(tmp_path / "a"), str(tmp_path / "b"))
    doc = json.loads(out.read_text())["layouts"]
    one_gpu, dcp = doc["pcp1"][0], doc["pcp2-dcp2"][0]
    assert one_gpu["greedy"][0]["first_token"] is None and one_gpu["samples_equal"]
    assert one_gpu["step_counts"] == [None, None]
    assert dcp["greedy"][0] == {"first_token": 1, "first_top5_logprobs": 1}
    assert dcp["step_counts"] == [{"steps": 40, "split_steps": 2},
                                  {"steps": 42, "split_steps": 2}]
