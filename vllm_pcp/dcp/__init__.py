"""Decode context parallelism: the KV cache sharded over the PCP ranks (``-pcp N -dcp N``):
:mod:`.layout`, :mod:`.plan` (pure, CPU), :mod:`.index`, :mod:`.attention` (FlashInfer)."""
