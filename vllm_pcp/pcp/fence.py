"""A fence between two plans of the same FlashInfer wrappers: ``plan`` writes a pinned host
buffer and copies it to the device asynchronously, and Model Runner V2 plans step N + 1
without synchronizing, so a second plan could overwrite the buffer before step N's copy
ran. The fence waits for an event recorded after the previous plan (rarely blocking: the
copies are issued ahead of the step's kernels).
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
