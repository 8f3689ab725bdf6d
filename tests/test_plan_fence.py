"""FlashInfer's plan fills a page-locked host buffer of its wrapper and copies it to the
device asynchronously, and vLLM's Model Runner V2 plans the next step without waiting for the
GPU: every plan of vllm-pcp's wrappers waits for the event recorded after the previous one
(``vllm_pcp.pcp.fence``), so no plan rewrites a buffer whose copy has not run."""
import torch

import fake_flashinfer
from manager_harness import descriptor, global_batch, managers, settings
from vllm_pcp.pcp import fence


class _Event:
    """A CUDA event's part the fence uses, logging into ``log``."""

    def __init__(self, log):
        self.log, self.id = log, len([e for e in log if e[0] == "record"])

    def record(self):
        self.log.append(("record", self.id))

    def synchronize(self):
        self.log.append(("wait", self.id))


def test_each_plan_waits_for_the_event_of_the_plan_before():
    log, plan = [], fence.PlanFence()
    events = []

    def planned(step):
        plan.wait()
        log.append(("plan", step))
        plan.record(torch.device("cuda"))

    original = torch.cuda.Event
    torch.cuda.Event = lambda: events.append(_Event(log)) or events[-1]
    try:
        for step in range(3):
            planned(step)
    finally:
        torch.cuda.Event = original
    assert log == [("plan", 0), ("record", 0), ("wait", 0), ("plan", 1), ("record", 1),
                   ("wait", 1), ("plan", 2), ("record", 2)]


def test_a_cpu_plan_records_nothing():
    plan = fence.PlanFence()
    plan.record(torch.device("cpu"))
    plan.wait()  # nothing recorded: returns at once
    assert plan._event is None


def test_the_dcp_attention_and_the_ragged_kernel_plan_inside_their_fence(monkeypatch):
    """Both planners call FlashInfer's plan between the fence's wait and its record."""
    fake_flashinfer.install(monkeypatch, float32=True)
    from vllm_pcp.dcp.attention import DCPAttention
    from vllm_pcp.dcp.plan import build_dcp_plan
    from vllm_pcp.pcp.ragged import RaggedSplitAttention

    log = []
    monkeypatch.setattr(fence.PlanFence, "wait", lambda self: log.append("wait"))
    monkeypatch.setattr(fence.PlanFence, "record", lambda self, device: log.append("record"))
    workspace = torch.empty(8)
    dcp = DCPAttention(workspace, 4, 2, 8, 4, torch.float32, 0.3)
    ragged = RaggedSplitAttention(workspace, 4, 2, 8, torch.float32, 0.3)
    for attention in (dcp._new, dcp._split, dcp._replicated, dcp._decode, ragged._wrapper):
        real = attention.plan
        monkeypatch.setattr(attention, "plan",
                            lambda *a, _real=real, **k: (log.append("plan"), _real(*a, **k)))
    batch = global_batch([0, 40], [64, 1])
    step = managers(2, settings(2, dcp=2))[0].partition_batch(batch, descriptor()).pcp.step
    dcp.plan(build_dcp_plan(step, 1), torch.zeros((2, 32), dtype=torch.int32))
    assert log[0] == "wait" and log[-1] == "record" and "plan" in log
    assert log.count("wait") == log.count("record") == 1
    log.clear()
    fresh = global_batch([0], [64])
    step = managers(2, settings(2))[0].partition_batch(fresh, descriptor()).pcp.step
    ragged.plan(step.plan, step.num_scheduled_tokens, torch.device("cpu"))
    assert log == ["wait", "plan", "record"]
