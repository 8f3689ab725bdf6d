"""Test-only vLLM plugin: the ranks of one engine share fewer GPUs than its world size.

Never installed and never part of the wheel: :mod:`tests.engine.shared_gpu` puts this
folder on ``PYTHONPATH`` (its ``.dist-info`` declares the ``vllm.general_plugins`` entry
point) and sets ``VLLM_PCP_TEST_SHARE_GPUS``. vLLM then loads it in every process of an
engine, as it loads vllm-pcp itself:

- in the process that builds the engine's config (``LLM``, ``vllm serve``),
  ``EngineArgs.create_engine_config`` decides whether to engage: when the engine's world
  size is larger than the GPUs this host shows (``auto``), or always (``force``). Engaged,
  it maps rank ``i`` to GPU ``i % gpus`` (``parallel_config.assigned_physical_gpu_ids``,
  which vLLM's ``--device-ids`` would refuse with duplicates), names the ``mp`` executor
  (vLLM refuses a world larger than the GPUs only when it picks the executor itself),
  turns custom all-reduce off (it needs one GPU per rank), with ``-tp`` also vLLM's
  FlashInfer and symmetric-memory all-reduces of the TP group (:data:`TP_ALLREDUCE_OFF`:
  over ranks of one GPU they stalled), and asks for ``--kv-cache-memory-bytes``: a rank's
  memory profile would count the other ranks' allocations on the same GPU. With ``--distributed-executor-backend ray`` it starts a
  local Ray head that declares ``world`` GPUs, so that vLLM's placement group of one GPU
  per rank is granted.
- the variables it sets then reach every process the engine starts: each process gives
  NCCL a host id of its own (``NCCL_HOSTID``), so NCCL, which refuses two ranks on one
  GPU of one host ("Duplicate GPU detected"), sees ranks on different hosts and talks over
  its network transport on the loopback interface. Ray workers fold the GPU ids Ray
  hands out onto the GPUs that exist.

Ranks that share a GPU check outputs, never speed. Without an MPS control daemon (NVIDIA's
Multi-Process Service) the GPU time-slices between the ranks' processes, and every collective
waits for the other rank's turn; with one, their kernels run side by side
(``tests/engine/shared_gpu.py mps start``). :func:`mps_serves` says which it is.

One more switch for the checks, off unless set: ``VLLM_PCP_TEST_ACCEPT_KV_DTYPES``
(comma-separated, e.g. ``fp8_e5m2``) lets ``-pcp`` engines take KV cache dtypes the plugin
refuses there until a GPU run shows them exact, so that the run can.
"""
from __future__ import annotations

import os
import signal

MODE_VAR = "VLLM_PCP_TEST_SHARE_GPUS"  # off (unset) | auto | force
ENGAGED_VAR = "VLLM_PCP_TEST_SHARED_GPUS_ENGAGED"  # the GPU count, set once engaged
ACCEPT_KV_DTYPES_VAR = "VLLM_PCP_TEST_ACCEPT_KV_DTYPES"  # e.g. "fp8_e5m2": -pcp takes them
MPS_PIPE_VAR, MPS_PIPE_DEFAULT = "CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"  # CUDA's own
# vLLM's all-reduces of the TP group that assume a GPU per rank: with -tp on shared GPUs
# the ranks stalled in FlashInfer's ("falling back to trtllm backend")
TP_ALLREDUCE_OFF = {"VLLM_ALLREDUCE_USE_FLASHINFER": "0", "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}

_registered = False


def register() -> None:
    """The entry point; idempotent, a no-op unless :data:`MODE_VAR` is auto or force."""
    global _registered
    if _registered or os.environ.get(MODE_VAR, "off") not in ("auto", "force"):
        return
    _registered = True
    print_stacks_on_signal()
    accept_kv_dtypes(os.environ.get(ACCEPT_KV_DTYPES_VAR, ""))
    if os.environ.get(ENGAGED_VAR):
        give_nccl_own_host()
    _wrap_engine_args()
    _wrap_device_ids_of_workers()


STACKS_SIGNAL = signal.SIGUSR1  # asks a check's engine processes for their Python stacks


def print_stacks_on_signal() -> None:
    """Every thread's Python stack to stderr on :data:`STACKS_SIGNAL`, so that a check
    that stops a hung engine (``tests/engine/engines.py``) logs where each process waited."""
    import faulthandler

    faulthandler.register(STACKS_SIGNAL, all_threads=True)


def accept_kv_dtypes(names: str) -> None:
    """Add ``names`` (comma-separated) to the KV cache dtypes ``-pcp`` takes
    (``vllm_pcp.config.PCP_CACHE_DTYPES``, read at start-up and by every layer)."""
    extra = tuple(n for n in names.split(",") if n)
    if extra:
        import vllm_pcp.config

        vllm_pcp.config.PCP_CACHE_DTYPES = (*vllm_pcp.config.PCP_CACHE_DTYPES, *extra)


def give_nccl_own_host() -> None:
    """This process's own NCCL host id (read when NCCL builds a communicator)."""
    os.environ["NCCL_HOSTID"] = f"vllm-pcp-shared-gpu-{os.getpid()}"


def shared_device_ids(world_size: int, visible: list[int]) -> list[int]:
    """Rank ``i``'s GPU: ``visible[i % len(visible)]`` (physical ids)."""
    return [visible[i % len(visible)] for i in range(world_size)]


def mps_pipe_dir(env=None) -> str:
    """Where a CUDA process of ``env`` (this one's) looks for an MPS control daemon."""
    return (os.environ if env is None else env).get(MPS_PIPE_VAR) or MPS_PIPE_DEFAULT


def mps_serves(env=None) -> bool:
    """Whether an MPS control daemon listens where a CUDA process of ``env`` looks for one
    (its ``control`` pipe exists): then the ranks' kernels run side by side."""
    return os.path.exists(os.path.join(mps_pipe_dir(env), "control"))


def engages(mode: str, world_size: int, gpus: int) -> bool:
    return mode == "force" or (mode == "auto" and world_size > gpus)


def _visible_physical_ids(gpus: int) -> list[int]:
    """The physical ids of this process's GPUs (``CUDA_VISIBLE_DEVICES`` composed)."""
    from vllm.platforms import current_platform

    control = os.environ.get(current_platform.device_control_env_var, "")
    if not control:
        return list(range(gpus))
    return [current_platform.device_control_id_to_physical_device_id(x)
            for x in control.split(",")][:gpus]


def engage(args, world_size: int, gpus: int) -> None:
    """Set up ``args`` (vLLM's EngineArgs) and this process's environment for
    ``world_size`` ranks on ``gpus`` GPUs."""
    from vllm.logger import init_logger

    if args.kv_cache_memory_bytes is None:
        raise ValueError(f"{world_size} ranks sharing {gpus} GPU(s) need "
                         "--kv-cache-memory-bytes: each rank's memory profile would count "
                         "the other ranks' allocations")
    if args.distributed_executor_backend is None:
        args.distributed_executor_backend = "mp"
    args.disable_custom_all_reduce = True
    args._pcp_shared_device_ids = shared_device_ids(world_size, _visible_physical_ids(gpus))
    os.environ.update({ENGAGED_VAR: str(gpus), "NCCL_SOCKET_IFNAME": "lo",
                       "VLLM_WORKER_MULTIPROC_METHOD": "spawn"})
    if args.tensor_parallel_size > 1:  # read by each rank as it builds its TP group
        os.environ.update(TP_ALLREDUCE_OFF)
    if args.distributed_executor_backend == "ray":
        _start_ray(world_size)
    init_logger("vllm.vllm_pcp.tests.shared_gpu").warning(
        "vllm-pcp test harness: %d ranks share %d GPU(s) (GPU ids %s), NCCL over its "
        "network transport on lo, %s: outputs are checked this way, never speed",
        world_size, gpus, args._pcp_shared_device_ids,
        "under MPS" if mps_serves() else "time-sliced (no MPS daemon at "
        f"{mps_pipe_dir()}: `tests/engine/shared_gpu.py mps start` runs one)")


def _start_ray(world_size: int) -> None:
    """A local Ray head that declares ``world_size`` GPUs, its address for the engine."""
    if os.environ.get("RAY_ADDRESS"):
        return
    import ray

    context = ray.init(num_gpus=world_size, include_dashboard=False)
    os.environ["RAY_ADDRESS"] = context.address_info["gcs_address"]


def _world_size(args) -> int:
    return (args.tensor_parallel_size * args.pipeline_parallel_size
            * args.prefill_context_parallel_size * args.data_parallel_size)


def _wrap_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    create, resolve = EngineArgs.create_engine_config, EngineArgs._resolve_device_ids

    def create_engine_config(self, *args, **kwargs):
        gpus, world = current_platform.device_count(), _world_size(self)
        if engages(os.environ.get(MODE_VAR, "off"), world, gpus):
            engage(self, world, gpus)
        return create(self, *args, **kwargs)

    def _resolve_device_ids(self):
        shared = getattr(self, "_pcp_shared_device_ids", None)
        return shared if shared is not None and not self.device_ids else resolve(self)

    EngineArgs.create_engine_config = create_engine_config
    EngineArgs._resolve_device_ids = _resolve_device_ids


def _wrap_device_ids_of_workers() -> None:
    """In an engaged worker, GPU ids past this host's GPUs (Ray's, from the GPUs its
    head declared) fold onto the real ones; vLLM's worker imports the setter when it
    initialises its device."""
    import vllm.platforms.interface as interface

    set_ids = interface.set_assigned_physical_gpu_ids

    def set_assigned_physical_gpu_ids(ids: list[int]) -> None:
        gpus = int(os.environ.get(ENGAGED_VAR) or 0)
        if gpus and any(i >= gpus for i in ids):
            ids = shared_device_ids(len(ids), _visible_physical_ids(gpus))
        set_ids(ids)

    interface.set_assigned_physical_gpu_ids = set_assigned_physical_gpu_ids
