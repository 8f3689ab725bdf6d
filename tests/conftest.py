import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "engine"))  # the GPU suites' pure parts


@pytest.fixture(autouse=True)
def _configs_see_enough_gpus(request, monkeypatch):
    """CPU tests build real VllmConfigs of 2-rank layouts. On a CUDA machine with fewer
    GPUs, vLLM's ParallelConfig refuses them (it counts this node's GPUs to pick an
    executor); these tests start no worker, so the platform shows 8 GPUs to them.
    tests/gpu sees the machine as it is."""
    if os.sep + "gpu" + os.sep in str(request.node.path):
        return
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        monkeypatch.setattr(current_platform, "device_count", lambda: 8)


@pytest.fixture(autouse=True)
def _no_pinned_memory_without_cuda(monkeypatch):
    """vLLM stages its host-to-device copies in pinned memory, which needs a CUDA driver;
    the CPU tests run vLLM's PCP manager on the CPU."""
    import torch

    if torch.cuda.is_available():
        return
    import vllm.utils.torch_utils  # noqa: F401  (the flag's home, imported first)
    from vllm.v1.utils import CpuGpuBuffer

    for name, module in list(sys.modules.items()):  # modules that copied the flag too
        if name.startswith("vllm") and getattr(module, "PIN_MEMORY", None) is True:
            monkeypatch.setattr(module, "PIN_MEMORY", False)
    defaults = CpuGpuBuffer.__init__.__kwdefaults__
    if defaults and defaults.get("pin_memory"):
        monkeypatch.setitem(defaults, "pin_memory", False)


def pytest_addoption(parser):
    parser.addoption("--results-dir", default=None,
                     help="where the GPU suites (tests/gpu, tests/engine) write their result "
                          "files (default: none written)")
    parser.addoption("--engine-work-dir", default="/tmp/vllm-pcp-engine",
                     help="tests/engine: models, raw engine outputs and logs")
    parser.addoption("--engine-max-tokens", type=int, default=32,
                     help="tests/engine: greedy tokens per prompt (the teacher scores them)")
