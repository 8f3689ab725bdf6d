"""Test helpers: a thread-backed process group for N ranks in one process, and a real
VllmConfig of a small model."""
from __future__ import annotations

import threading

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


def real_vllm_config(model_dir, monkeypatch, parallel: dict, hf: dict | None = None,
                     runner: str = "auto", **vllm_kwargs):
    """vLLM's own VllmConfig of a small Qwen2 model written to ``model_dir`` (8 query
    heads, 2 KV heads, head size 8; ``hf`` overrides its config), the plugin
    registered and Triton shown as present, as on a GPU host. ``parallel``:
    ParallelConfig's arguments; ``vllm_kwargs``: VllmConfig's other parts."""
    from transformers import Qwen2Config

    model = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2, vocab_size=256,
                 max_position_embeddings=4096)
    Qwen2Config(**{**model, **(hf or {})}).save_pretrained(model_dir)
    return vllm_config_of(model_dir, monkeypatch, parallel, runner, **vllm_kwargs)


def vllm_config_of(model_dir, monkeypatch, parallel: dict, runner: str = "auto",
                   **vllm_kwargs):
    """vLLM's own VllmConfig of the model whose ``config.json`` is in ``model_dir``,
    as :func:`real_vllm_config` builds it."""
    import vllm.config.vllm as vllm_config_module
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig

    import vllm_pcp

    vllm_pcp.register()  # the DCP == PCP patch of ModelConfig.verify_with_parallel_config
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True,
                                 dtype="bfloat16", runner=runner),
        device_config=DeviceConfig(device="cuda"),
        parallel_config=ParallelConfig(**parallel), **vllm_kwargs)
