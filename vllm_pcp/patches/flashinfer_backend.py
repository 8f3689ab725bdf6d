"""Override of vLLM's ``FLASHINFER`` entry in ``vllm.v1.attention.backends.registry``.

Why
    vLLM 0.26.0's ``FlashInferImpl`` has no PCP support (``supports_pcp`` is
    False) and its DCP is not exact; the plugin's backend all-gathers K/V
    before the cache write and runs DCP attention itself. Workers resolve the
    backend by name, so the plugin's class must stand behind ``FLASHINFER``.
How
    ``register_backend(AttentionBackendEnum.FLASHINFER, PCP_BACKEND)``, vLLM's
    public hook for out-of-tree backends, in every process. It applies to
    every user of FlashInfer, PCP or not: at PCP = 1 without DCP the subclass
    runs exactly as stock FlashInfer (it only adds behaviour when a step
    carries PCP metadata).
Upstream status
    Not upstream. vLLM's GQA PCP for FlashInfer (PRs #26864 and #28723, after
    RFC #25749) was closed unmerged; upstream PCP moved to Model Runner V2 for
    MLA first (#46570). vLLM's own FlashInfer DCP gives wrong tokens (issue
    #41623; fix proposed in PR #48003, open). Candidate diff: ``supports_pcp``
    for ``FlashInferImpl`` with the K/V gather of :mod:`vllm_pcp.backend`.
    Pinned by the tests the index (``README.md`` here) names.
Removal plan
    Drop once vLLM's FlashInfer backend runs GQA PCP and exact DCP itself.
"""
from __future__ import annotations

PCP_BACKEND = "vllm_pcp.backend.PCPFlashInferBackend"
SYMBOL = ("vllm.v1.attention.backends.registry", "register_backend")


def apply() -> bool:
    """Point ``FLASHINFER`` at the plugin's backend (idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.FLASHINFER, PCP_BACKEND)
    return True
