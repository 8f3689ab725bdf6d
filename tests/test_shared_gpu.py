"""The test harness that lets an engine's ranks share fewer GPUs (tests/engine/shared_gpu.py
and its test-only plugin): when it engages, what it sets, and every symbol of the installed
vLLM it relies on, so that an upgrade that moves one fails here rather than on a GPU host."""
import inspect
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "engine"))
import shared_gpu  # noqa: E402
import vllm_pcp_shared_gpu as plugin  # noqa: E402


def test_env_puts_the_plugin_first_on_the_path_and_names_the_mode():
    env = shared_gpu.env(base={"PYTHONPATH": f"/a{os.pathsep}{shared_gpu.PLUGIN_DIR}"})
    assert env == {"PYTHONPATH": f"{shared_gpu.PLUGIN_DIR}{os.pathsep}/a",
                   plugin.MODE_VAR: "auto"}
    assert shared_gpu.env("force", base={})[plugin.MODE_VAR] == "force"
    assert shared_gpu.env(base={plugin.MODE_VAR: "force"})[plugin.MODE_VAR] == "force"
    with pytest.raises(ValueError, match="auto, force"):
        shared_gpu.env("sometimes", base={})


def test_the_shell_gets_export_lines():
    out = subprocess.run([sys.executable, shared_gpu.__file__, "env", "force"],
                         capture_output=True, text=True, timeout=60).stdout.splitlines()
    assert out[0].startswith("export PYTHONPATH=") and shared_gpu.PLUGIN_DIR in out[0]
    assert out[1] == f"export {plugin.MODE_VAR}=force"


def test_vllm_finds_the_plugin_through_its_entry_point_only_on_that_path():
    code = ("import json; from importlib.metadata import entry_points; "
            "print(json.dumps([e.value for e in entry_points(group='vllm.general_plugins')]))")

    def values(env):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, env=env)
        return json.loads(out.stdout)

    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    assert "vllm_pcp_shared_gpu:register" in values({**clean, **shared_gpu.env(base=clean)})
    assert "vllm_pcp_shared_gpu:register" not in values(clean)


@pytest.mark.parametrize("mode,world,gpus,engaged", [
    ("auto", 2, 1, True), ("auto", 8, 1, True), ("auto", 2, 2, False), ("auto", 1, 1, False),
    ("force", 2, 2, True), ("force", 1, 8, True), ("off", 8, 1, False)])
def test_it_engages_only_with_fewer_gpus_than_ranks_unless_forced(mode, world, gpus, engaged):
    assert plugin.engages(mode, world, gpus) is engaged


def test_ranks_take_the_gpus_round_robin():
    assert plugin.shared_device_ids(2, [0]) == [0, 0]
    assert plugin.shared_device_ids(8, [3, 5]) == [3, 5, 3, 5, 3, 5, 3, 5]


def _engine_args(tmp_path, **kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(tmp_path), **kw)


def _wrapped(monkeypatch, gpus: int, mode: str = "auto"):
    """The plugin's EngineArgs wrappers over a stand-in create_engine_config that reports
    what vLLM's would build the ParallelConfig from."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    def fake_create(self, *args, **kwargs):
        return (self.distributed_executor_backend, self.disable_custom_all_reduce,
                self._resolve_device_ids())

    monkeypatch.setattr(EngineArgs, "create_engine_config", fake_create)
    monkeypatch.setattr(EngineArgs, "_resolve_device_ids", EngineArgs._resolve_device_ids)
    monkeypatch.setattr(current_platform, "device_count", lambda: gpus)
    monkeypatch.setenv(plugin.MODE_VAR, mode)
    for var in (plugin.ENGAGED_VAR, "NCCL_SOCKET_IFNAME", "VLLM_WORKER_MULTIPROC_METHOD",
                current_platform.device_control_env_var, *plugin.TP_ALLREDUCE_OFF):
        monkeypatch.setenv(var, "")  # what the wrappers set is undone after the test
        monkeypatch.delenv(var)
    plugin._wrap_engine_args()


def test_engaged_the_ranks_share_one_gpu_over_the_mp_executor(tmp_path, monkeypatch):
    _wrapped(monkeypatch, gpus=1)
    args = _engine_args(tmp_path, prefill_context_parallel_size=2, tensor_parallel_size=2,
                        kv_cache_memory_bytes=1 << 30)
    assert args.create_engine_config() == ("mp", True, [0, 0, 0, 0])
    assert os.environ[plugin.ENGAGED_VAR] == "1"
    assert os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert {k: os.environ[k] for k in plugin.TP_ALLREDUCE_OFF} == {
        "VLLM_ALLREDUCE_USE_FLASHINFER": "0", "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}


def test_without_tp_vllms_tp_all_reduces_are_left_as_they_are(tmp_path, monkeypatch):
    """Only a TP group all-reduces with FlashInfer or symmetric memory: an engine without
    -tp sharing a GPU keeps vLLM's defaults."""
    _wrapped(monkeypatch, gpus=1)
    args = _engine_args(tmp_path, prefill_context_parallel_size=4,
                        kv_cache_memory_bytes=1 << 30)
    assert args.create_engine_config() == ("mp", True, [0, 0, 0, 0])
    assert not set(plugin.TP_ALLREDUCE_OFF) & set(os.environ)


def test_with_a_gpu_per_rank_nothing_changes(tmp_path, monkeypatch):
    _wrapped(monkeypatch, gpus=2)
    args = _engine_args(tmp_path, prefill_context_parallel_size=2)
    assert args.create_engine_config() == (None, False, None)
    assert plugin.ENGAGED_VAR not in os.environ


def test_forced_and_with_visible_devices_the_ids_are_physical(tmp_path, monkeypatch):
    from vllm.platforms import current_platform

    _wrapped(monkeypatch, gpus=2, mode="force")
    monkeypatch.setenv(current_platform.device_control_env_var, "4,6")
    args = _engine_args(tmp_path, prefill_context_parallel_size=4,
                        kv_cache_memory_bytes=1 << 30)
    assert args.create_engine_config() == ("mp", True, [4, 6, 4, 6])


def test_a_shared_gpu_needs_a_fixed_kv_pool(tmp_path, monkeypatch):
    _wrapped(monkeypatch, gpus=1)
    args = _engine_args(tmp_path, prefill_context_parallel_size=2)
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes"):
        args.create_engine_config()


def test_workers_fold_gpu_ids_past_the_hosts_onto_its_gpus(monkeypatch):
    import vllm.platforms.interface as interface

    seen = []
    monkeypatch.setattr(interface, "set_assigned_physical_gpu_ids", seen.append)
    from vllm.platforms import current_platform

    monkeypatch.setenv(plugin.ENGAGED_VAR, "1")
    monkeypatch.delenv(current_platform.device_control_env_var, raising=False)
    plugin._wrap_device_ids_of_workers()
    interface.set_assigned_physical_gpu_ids([0, 1])  # Ray's ids of a head declaring 2 GPUs
    interface.set_assigned_physical_gpu_ids([0, 0])  # the mp executor's: already folded
    assert seen == [[0, 0], [0, 0]]


def test_each_process_gives_nccl_a_host_of_its_own(monkeypatch):
    monkeypatch.delenv("NCCL_HOSTID", raising=False)
    plugin.give_nccl_own_host()
    assert os.environ["NCCL_HOSTID"] == f"vllm-pcp-shared-gpu-{os.getpid()}"


def test_a_check_can_let_pcp_take_a_kv_cache_dtype_the_plugin_refuses(monkeypatch, tmp_path):
    """``VLLM_PCP_TEST_ACCEPT_KV_DTYPES=fp8_e5m2``: start-up and the layers take that cache
    at -pcp 2 (DCP keeps its own refusal); unset, both refuse it."""
    import vllm_pcp.config as config
    from test_config import DCP2, _config

    monkeypatch.setattr(config, "PCP_CACHE_DTYPES", config.PCP_CACHE_DTYPES)
    with pytest.raises(config.PCPConfigError):
        config.prepare_pcp_config(_config(cache_dtype="fp8_e5m2"))
    plugin.accept_kv_dtypes("")
    with pytest.raises(config.PCPConfigError):
        config.prepare_pcp_config(_config(cache_dtype="fp8_e5m2"))
    plugin.accept_kv_dtypes("fp8_e5m2")
    assert config.prepare_pcp_config(_config(cache_dtype="fp8_e5m2"))
    with pytest.raises(config.PCPConfigError, match="--kv-cache-dtype fp8_e5m2"):
        config.prepare_pcp_config(_config(cache_dtype="fp8_e5m2", **DCP2))


# --- what the harness relies on in the installed vLLM -----------------------------------

def test_vllm_builds_the_parallel_config_from_the_fields_the_harness_sets():
    from vllm.engine.arg_utils import EngineArgs

    source = inspect.getsource(EngineArgs.create_engine_config)
    assert "assigned_physical_gpu_ids=self._resolve_device_ids()" in source
    assert "distributed_executor_backend=self.distributed_executor_backend" in source
    assert "disable_custom_all_reduce=self.disable_custom_all_reduce" in source
    fields = inspect.signature(EngineArgs).parameters
    for name in ("device_ids", "kv_cache_memory_bytes", "distributed_executor_backend",
                 "disable_custom_all_reduce", "tensor_parallel_size", "pipeline_parallel_size",
                 "prefill_context_parallel_size", "data_parallel_size"):
        assert name in fields, name
    # vLLM's --device-ids refuses a GPU twice: why the harness sets the ids past it
    assert "must not contain duplicates" in inspect.getsource(EngineArgs._resolve_device_ids)


def test_vllm_refuses_a_world_larger_than_the_gpus_only_when_it_picks_the_executor():
    from vllm.config.parallel import ParallelConfig

    source = inspect.getsource(ParallelConfig.__post_init__)
    guard = source.index("if self.distributed_executor_backend is None and")
    assert guard < source.index("is larger than the number of") < guard + 1500


def test_the_worker_maps_its_local_rank_through_the_assigned_ids():
    from vllm.v1.worker.gpu_worker import Worker

    source = inspect.getsource(Worker.init_device)
    assert "from vllm.platforms.interface import set_assigned_physical_gpu_ids" in source
    assert "set_assigned_physical_gpu_ids(assigned_physical_gpu_ids)" in source
    assert "logical_device_id_to_visible_device_id(self.local_rank)" in source


def test_vllm_loads_general_plugins_before_it_builds_a_config_and_in_every_worker():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import DEFAULT_PLUGINS_GROUP
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    assert DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"
    assert "load_general_plugins()" in inspect.getsource(EngineArgs.__post_init__)
    assert "load_general_plugins()" in inspect.getsource(WorkerWrapperBase.init_worker)


def test_vllm_reads_the_variables_the_harness_sets():
    import vllm.envs as envs
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    for var in ("VLLM_WORKER_MULTIPROC_METHOD", "VLLM_PLUGINS", *plugin.TP_ALLREDUCE_OFF):
        assert var in envs.environment_variables, var
    # the TP group's all-reduce backends, read as each rank builds it (after the harness
    # set them); other groups never take them
    source = inspect.getsource(CudaCommunicator.__init__)
    assert 'if unique_name.split(":")[0] != "tp":' in source
    assert "use_torch_symm_mem = envs.VLLM_ALLREDUCE_USE_SYMM_MEM" in source
    assert "envs.VLLM_ALLREDUCE_USE_FLASHINFER and" in source
    from vllm.v1.executor import ray_utils

    # Ray: one GPU per rank in vLLM's placement group, hence a head declaring `world` GPUs
    assert "{device_str: 1.0} for _ in range(parallel_config.world_size)" in \
        inspect.getsource(ray_utils.initialize_ray_cluster)


FAKE_MPS_CONTROL = """#!/bin/sh
# nvidia-cuda-mps-control's two uses here: -d starts the daemon, "quit" on stdin ends it
echo "$@ $(cat 2>/dev/null)" >> "$CUDA_MPS_PIPE_DIRECTORY/calls"
if [ "$1" = -d ]; then touch "$CUDA_MPS_PIPE_DIRECTORY/control"; else rm "$CUDA_MPS_PIPE_DIRECTORY/control"; fi
"""


def test_mps_starts_once_in_its_pipe_folder_and_quits(tmp_path, monkeypatch):
    """``mps start`` runs the control daemon in the caller's pipe folder (not twice) and
    prints the variable that points engines at it; ``mps stop`` quits it."""
    bin_dir, pipe = tmp_path / "bin", tmp_path / "pipe"
    bin_dir.mkdir()
    (bin_dir / "nvidia-cuda-mps-control").write_text(FAKE_MPS_CONTROL)
    (bin_dir / "nvidia-cuda-mps-control").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
    assert not shared_gpu.mps_serves()
    cli = [sys.executable, shared_gpu.__file__, "mps"]
    out = subprocess.run([*cli, "start"], capture_output=True, text=True, check=True).stdout
    assert out == f"export CUDA_MPS_PIPE_DIRECTORY={pipe}\n" and shared_gpu.mps_serves()
    subprocess.run([*cli, "start"], check=True)
    assert not shared_gpu.mps_serves(shared_gpu.without_mps())  # the dead-rank check's engine
    subprocess.run([*cli, "stop"], check=True)
    assert not shared_gpu.mps_serves()
    assert (pipe / "calls").read_text().split("\n")[:2] == ["-d ", " quit"]
    assert plugin.mps_pipe_dir({}) == "/tmp/nvidia-mps"  # CUDA's default


def test_the_probe_times_pairs_of_ranks_and_compares_mps(tmp_path):
    """The probe's ranks on gloo (CPU): each reports its collectives and step; the summary
    takes the slowest rank per run and the time-sliced / MPS ratio."""
    import probe_shared_gpu as probe

    run = probe.probe(1, str(tmp_path), backend="gloo", port=29650)
    assert run["pairs"] == 1 and not run["mps"] and [r["rank"] for r in run["ranks"]] == [0, 1]
    assert all(r["step_30_layers_ms"] > 0 and r["all_gather_4MiB"]["median_ms"] > 0
               for r in run["ranks"])
    runs = [{"pairs": 3, "mps": mps, "ranks": [{"step_30_layers_ms": t}, {"step_30_layers_ms": 2}]}
            for mps, t in ((False, 270.0), (True, 3.0))]
    assert probe.summarize(runs) == {"slowest_step_30_layers_ms": {
        "time-sliced-3": 270.0, "mps-3": 3.0}, "mps_speedup_3_pairs": 90.0}


def test_the_dead_rank_check_runs_its_engine_outside_mps(monkeypatch, tmp_path):
    """The faults check kills a rank of its layout's server: that server's CUDA finds no MPS
    daemon, so the kill cannot reach engines beside it; its -pcp 1 reference stays as set."""
    import test_serve

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    (tmp_path / "control").touch()  # a daemon listens where this process looks
    seen = {}

    def on_server(request, layout, model, what, flags, ask, env=None):
        seen[layout] = env
        return {"goals": {"met": True}}

    monkeypatch.setattr(test_serve, "on_server", on_server)
    monkeypatch.setattr(test_serve.serve, "cached", lambda request, name, compute: compute())
    monkeypatch.setattr(test_serve.serve, "write_result", lambda *a, **k: None)
    test_serve.test_bad_requests_and_dead_rank(None, "pcp2-split-all")
    assert seen["pcp1"] is None and shared_gpu.mps_serves()
    assert not shared_gpu.mps_serves({**os.environ, **seen["pcp2-split-all"]})
