"""The entry point is installed and registration is idempotent."""
from importlib.metadata import entry_points

from vllm.v1.attention.backends.registry import AttentionBackendEnum

import vllm_pcp
from vllm_pcp.backend import PCPFlashInferBackend


def test_entry_point_is_installed():
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "vllm_pcp"]
    assert [ep.value for ep in eps] == ["vllm_pcp:register"]
    assert eps[0].load() is vllm_pcp.register


def test_register_is_idempotent():
    vllm_pcp.register()
    vllm_pcp.register()
    assert AttentionBackendEnum.FLASHINFER.get_class() is PCPFlashInferBackend


def test_vllm_loads_the_plugin():
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    assert vllm_pcp._registered
    assert AttentionBackendEnum.FLASHINFER.get_class() is PCPFlashInferBackend
