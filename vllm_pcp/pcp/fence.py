"""A fence between two plans of the same FlashInfer wrappers.

FlashInfer's ``plan`` writes its schedule into a page-locked host buffer of the wrapper and
copies it to the device with ``cudaMemcpyAsync``. vLLM's Model Runner V2 plans step N + 1 while
the GPU may not yet have run step N's copy (it does not synchronize between steps), and a
second plan into the same host buffer before that copy ran would hand step N the schedule of
step N + 1. The fence records an event after each plan and waits for it before the next one:
the wait is for the previous step's copies, issued ahead of its kernels, so it rarely blocks.
"""
from __future__ import annotations

import torch


class PlanFence:
    """``wait()`` before planning a set of wrappers, ``record()`` after."""

    def __init__(self):
        self._event = None

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def record(self, device: torch.device) -> None:
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
