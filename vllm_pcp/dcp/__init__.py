"""Decode context parallelism: the KV cache sharded over the PCP ranks (``-pcp N -dcp N``).

:mod:`.layout` which rank stores which token; :mod:`.plan` one step's attention rows
per rank (pure, CPU); :mod:`.index` the device index tensors of a plan;
:mod:`.attention` the FlashInfer executor.
"""
