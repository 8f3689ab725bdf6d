"""The entry point: installed, idempotent, and inert but for the ``-pcp`` refusal on a
vLLM other than the one vllm-pcp runs on."""
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
from vllm.v1.attention.backends.registry import AttentionBackendEnum

import vllm_pcp
from vllm_pcp.backend import PCPFlashInferBackend
from vllm_pcp.config import VLLM_VERSION, PCPConfigError, version_refusal


def test_entry_point_is_installed():
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "vllm_pcp"]
    assert [ep.value for ep in eps] == ["vllm_pcp:register"]
    assert eps[0].load() is vllm_pcp.register


def test_vllm_loads_the_plugin():
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    assert vllm_pcp._registered
    assert AttentionBackendEnum.FLASHINFER.get_class() is PCPFlashInferBackend


class _Recorder:
    """Stands in for what ``register`` installs: records each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


@pytest.fixture
def fresh_process(monkeypatch):
    """``register`` as in a process that has not run it, what it installs and logs
    recorded: ``(calls, logged)``."""
    import vllm.logger
    import vllm.v1.attention.backends.registry as registry

    import vllm_pcp.patches as patches

    recorder, logged = _Recorder(), []
    monkeypatch.setattr(vllm_pcp, "_registered", False)
    monkeypatch.setattr(registry, "register_backend", recorder("register_backend"))
    monkeypatch.setattr(patches, "apply_all", recorder("apply_all"))
    monkeypatch.setattr(patches, "refuse_pcp", recorder("refuse_pcp"))
    monkeypatch.setattr(vllm.logger, "init_logger", lambda name: SimpleNamespace(
        info=lambda msg, *a: logged.append(("info", msg % a)),
        warning=lambda msg, *a: logged.append(("warning", msg % a))))
    return recorder.calls, logged


def test_register_installs_the_backend_and_the_patches_once(fresh_process):
    calls, logged = fresh_process
    vllm_pcp.register()
    vllm_pcp.register()
    assert calls == [
        ("register_backend", (AttentionBackendEnum.FLASHINFER, vllm_pcp.BACKEND), {}),
        ("apply_all", (), {})]
    assert logged == [("info", f"vllm-pcp {vllm_pcp.__version__} registered: FLASHINFER "
                               "backend with PCP support")]


def test_on_another_vllm_only_the_pcp_refusal_is_installed(fresh_process, monkeypatch):
    import vllm

    calls, logged = fresh_process
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    vllm_pcp.register()
    vllm_pcp.register()
    refusal = version_refusal("0.34.0")
    assert refusal and VLLM_VERSION in refusal and "drop -pcp" in refusal
    assert calls == [("refuse_pcp", (refusal,), {})]
    assert logged == [("warning", f"vllm-pcp {vllm_pcp.__version__} is inactive: {refusal}")]


def test_the_refusal_stops_pcp_configs_and_passes_the_others():
    """What ``refuse_pcp`` installs on the platform: vLLM's own check runs, then ``-pcp``
    on a non-MLA model is refused with the message; everything else passes."""
    from vllm_pcp.patches import platform_config

    seen = []

    class Platform:
        @classmethod
        def check_and_update_config(cls, vllm_config):
            seen.append(vllm_config)

    def config(pcp, use_mla=False):
        return SimpleNamespace(parallel_config=SimpleNamespace(
            prefill_context_parallel_size=pcp), model_config=SimpleNamespace(use_mla=use_mla))

    assert platform_config.wrap(Platform, refusal="needs vLLM X")
    assert not platform_config.wrap(Platform, refusal="needs vLLM X")  # once
    with pytest.raises(PCPConfigError, match="^needs vLLM X$"):
        Platform.check_and_update_config(config(2))
    Platform.check_and_update_config(config(1))
    Platform.check_and_update_config(config(2, use_mla=True))
    assert len(seen) == 3


def test_registered_here_the_backend_is_the_plugins():
    vllm_pcp.register()
    assert vllm_pcp._registered
    assert AttentionBackendEnum.FLASHINFER.get_class() is PCPFlashInferBackend
