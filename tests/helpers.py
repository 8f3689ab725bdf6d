"""Test helpers: a thread-backed process group for N ranks in one process, the step
object vLLM's PCP manager hands the attention (:func:`pcp_step`), a real VllmConfig of a
small model, vLLM's FlashInfer builder on the CPU (its layers and the plan of a split
step's local rows)."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import torch

JOIN_TIMEOUT_S = 900


class ThreadGroup:
    """``world_size`` ranks as threads; ``rank(r)`` is rank r's GroupCoordinator stand-in."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size)
        self._slots = [None] * world_size

    def rank(self, rank: int) -> "_RankView":
        return _RankView(self, rank)

    def run(self, fn):
        """Run ``fn(rank)`` on every rank in its own thread; return the results."""
        results, errors = [None] * self.world_size, []

        def target(r):
            try:
                results[r] = fn(r)
            except BaseException as exc:  # surfaced below
                errors.append(exc)
                self._barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:  # generous: a first call on a GPU may compile FlashInfer kernels
            t.join(timeout=JOIN_TIMEOUT_S)
        if errors:
            raise errors[0]
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        if stuck:
            self._barrier.abort()
            raise TimeoutError(f"ranks {stuck} still running after {JOIN_TIMEOUT_S} s")
        return results


class _RankView:
    def __init__(self, group: ThreadGroup, rank: int):
        self._group = group
        self.world_size = group.world_size
        self.rank_in_group = rank

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        g = self._group
        g._slots[self.rank_in_group] = x
        g._barrier.wait()
        out = torch.cat(list(g._slots), dim=dim)
        g._barrier.wait()
        return out

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        g, n = self._group, self.world_size
        block = x.shape[0] // n
        g._slots[self.rank_in_group] = x
        g._barrier.wait()
        r = self.rank_in_group
        out = torch.cat([g._slots[d][r * block:(r + 1) * block] for d in range(n)])
        g._barrier.wait()
        return out


def pcp_settings(world: int, dcp: int = 1, min_split_tokens: int = 2,
                 decode_policy: str = "auto", is_moe: bool = False, **knobs):
    """What :meth:`vllm_pcp.knobs.PCPSettings.from_vllm_config` makes of ``-pcp world``
    (``-dcp dcp``) with ``pcp_min_split_tokens`` and ``pcp_decode_policy`` (and any other
    ``pcp_*`` knob, by its name less the prefix)."""
    from vllm_pcp.knobs import PCPSettings

    additional = {"pcp_min_split_tokens": min_split_tokens,
                  "pcp_decode_policy": decode_policy,
                  **{f"pcp_{name}": value for name, value in knobs.items()}}
    return PCPSettings.from_vllm_config(SimpleNamespace(
        parallel_config=SimpleNamespace(prefill_context_parallel_size=world,
                                        decode_context_parallel_size=dcp),
        model_config=SimpleNamespace(is_moe=is_moe), additional_config=additional))


def default_is_prefilling(computed, scheduled) -> np.ndarray:
    """vLLM's ``is_prefilling`` of a step whose one-token requests over cached tokens
    decode and whose other requests prefill."""
    computed, scheduled = np.asarray(computed), np.asarray(scheduled)
    return ~((scheduled == 1) & (computed > 0))


def pcp_step(computed, scheduled, world: int, rank: int = 0, *, dcp: int = 1,
             min_split_tokens: int = 2, prefill_lens=None, is_prefilling=None,
             decode_policy: str = "auto", settings=None):
    """The :class:`vllm_pcp.manager.PCPStep` that ``GQAPCPManager`` makes on ``rank`` for
    a step of these per-request ``computed`` and ``scheduled`` tokens: its split from
    :meth:`GQAPCPManager.plan_split` under :func:`pcp_settings` (so with ``-dcp`` every
    split chunk has at least 2N tokens, at DCP = 1 at least 4N), ``gathered`` as the
    manager decides it (False: nothing split and every rank runs the step's tokens in
    step order)."""
    from vllm_pcp.manager import GQAPCPManager, PCPStep

    settings = settings or pcp_settings(world, dcp, min_split_tokens, decode_policy)
    computed = np.asarray(computed, dtype=np.int64).reshape(-1)
    scheduled = np.asarray(scheduled, dtype=np.int64).reshape(-1)
    if is_prefilling is None:
        is_prefilling = default_is_prefilling(computed, scheduled)
    manager = SimpleNamespace(settings=settings, pcp_world_size=world)
    plans = tuple(GQAPCPManager.plan_split(manager, computed, scheduled,
                                           np.asarray(is_prefilling, dtype=bool),
                                           prefill_lens))
    local = plans[rank]
    in_step_order = torch.equal(local.local_token_indices, torch.arange(local.num_tokens))
    unsplit_local = settings.unsplit_steps_local and not local.is_split and in_step_order
    return PCPStep(plans, rank, computed, scheduled, gathered=not unsplit_local)


def restore(group, out_local: torch.Tensor, step) -> torch.Tensor:
    """vLLM's restore of a PCP step's output (``PCPManager.restore_hidden_states``): every
    rank's ``P`` rows all-gathered, then read in scheduler order; a step that keeps its
    rows local (``step.gathered`` False) is in step order already."""
    from vllm_pcp.pcp.exchange import all_gather_padded

    if not step.gathered:
        return out_local
    plan = step.plan
    rows = out_local.reshape(out_local.shape[0], -1)
    gathered = all_gather_padded(group, rows, plan.num_padded_tokens_per_rank)
    return gathered[plan.restore_indices.to(rows.device)].reshape(-1, *out_local.shape[1:])


def real_vllm_config(model_dir, monkeypatch, parallel: dict, hf: dict | None = None,
                     runner: str = "auto", dtype: str = "bfloat16", **vllm_kwargs):
    """vLLM's own VllmConfig of a small Qwen2 model written to ``model_dir`` (8 query
    heads, 2 KV heads, head size 8; ``hf`` overrides its config) in ``dtype``, the
    plugin registered and Triton shown as present, as on a GPU host. ``parallel``:
    ParallelConfig's arguments; ``vllm_kwargs``: VllmConfig's other parts."""
    from transformers import Qwen2Config

    model = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2, vocab_size=256,
                 max_position_embeddings=4096)
    Qwen2Config(**{**model, **(hf or {})}).save_pretrained(model_dir)
    return vllm_config_of(model_dir, monkeypatch, parallel, runner, dtype, **vllm_kwargs)


def vllm_config_of(model_dir, monkeypatch, parallel: dict, runner: str = "auto",
                   dtype: str = "bfloat16", model: dict | None = None, **vllm_kwargs):
    """vLLM's own VllmConfig of the model whose ``config.json`` is in ``model_dir``,
    as :func:`real_vllm_config` builds it; ``model``: ModelConfig's other arguments."""
    import vllm.config.vllm as vllm_config_module
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    import vllm_pcp

    vllm_pcp.register()  # the DCP == PCP patch of ModelConfig.verify_with_parallel_config
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True,
                                 dtype=dtype, runner=runner, **(model or {})),
        device_config=DeviceConfig(device="cuda"),
        parallel_config=parallel_config_of(parallel), **vllm_kwargs)


def parallel_config_of(parallel: dict):
    """vLLM's ParallelConfig of ``parallel`` on vLLM's mp executor unless it names one:
    without a named executor vLLM refuses more ranks than the host has GPUs."""
    from vllm.config import ParallelConfig

    return ParallelConfig(**{"distributed_executor_backend": "mp", **parallel})


class _RecordingPrefillWrapper:
    """Stands in for FlashInfer's BatchPrefillWithPagedKVCacheWrapper: keeps ``plan``'s
    arguments."""

    plans: list = []

    def __init__(self, *args, **kwargs):
        pass

    def plan(self, **kwargs):
        self.plans.append(kwargs)


class _NoKernel:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def local_attention_metadata(plan, block_table: torch.Tensor):
    """vLLM's ``CommonAttentionMetadata`` of a PCP plan's local rows (``plan``: a
    ``PrefillContextParallelMetadata``), as the runner builds it for the stock builder."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    return CommonAttentionMetadata(
        query_start_loc=plan.query_start_loc, query_start_loc_cpu=plan.query_start_loc,
        seq_lens=plan.seq_lens, seq_lens_cpu_upper_bound=plan.seq_lens,
        num_reqs=plan.num_rows, num_actual_tokens=plan.num_local_tokens,
        max_query_len=plan.max_query_len, max_seq_len=int(plan.seq_lens.max()), causal=True,
        block_table_tensor=block_table,
        slot_mapping=torch.zeros(plan.num_local_tokens, dtype=torch.int64))


def plan_split_rows(builder, monkeypatch, rank: int, scheduled=(64,)):
    """vLLM's FlashInfer builder ``builder`` on rank ``rank``'s local rows of fresh
    prompts of ``scheduled`` tokens (one of 64 by default) split over 2 ranks,
    FlashInfer's kernels replaced by recorders: the rank's PCP plan, the built metadata,
    and the arguments of the prefill wrapper's ``plan``."""
    import vllm.v1.attention.backends.flashinfer as flashinfer
    from vllm.config import set_current_vllm_config

    from vllm_pcp.pcp.partition import build_pcp_metadata_all_ranks

    monkeypatch.setattr(flashinfer, "BatchPrefillWithPagedKVCacheWrapper",
                        _RecordingPrefillWrapper)
    monkeypatch.setattr(flashinfer, "_copy_page_indices_kernel", _NoKernel())
    monkeypatch.setattr(flashinfer, "use_trtllm_attention", lambda *a, **k: False)
    monkeypatch.setattr(_RecordingPrefillWrapper, "plans", [])
    plan = build_pcp_metadata_all_ranks([0] * len(scheduled), list(scheduled), 2,
                                        min_split_tokens=2)[rank]
    cm = local_attention_metadata(
        plan, torch.arange(4, dtype=torch.int32).repeat(plan.num_rows, 1))
    with set_current_vllm_config(builder.vllm_config):
        metadata = builder.build(common_prefix_len=0, common_attn_metadata=cm)
    [planned] = _RecordingPrefillWrapper.plans
    return plan, metadata, planned


def attention_layer(impl):
    """An attention layer holding ``impl``, as vLLM's static forward context holds it."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layer_cls = type("Layer", (AttentionLayerBase,), dict(
        __init__=lambda self, impl: setattr(self, "impl", impl),
        get_attn_backend=lambda self: None, get_kv_cache_spec=lambda self, c: None))
    return layer_cls(impl)


def flashinfer_on_cpu(monkeypatch, sm90: bool = False) -> None:
    """vLLM's FlashInfer backend as its builder sees a GPU shown as SM90 or not, on the
    CPU: no trtllm-gen kernels, no pinned memory."""
    import vllm.v1.attention.backends.flashinfer as flashinfer

    monkeypatch.setattr(flashinfer, "can_use_trtllm_attention", lambda *a, **k: False)
    monkeypatch.setattr(flashinfer, "PIN_MEMORY", False)
    import vllm.v1.utils as v1_utils

    monkeypatch.setattr(v1_utils, "PIN_MEMORY", False)  # CpuGpuBuffer's copies
    monkeypatch.setattr(flashinfer.current_platform, "is_device_capability",
                        lambda capability: sm90 and capability == 90)
