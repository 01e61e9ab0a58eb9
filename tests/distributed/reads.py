"""Host reads of tensors, told apart by where the tensor lives: a device stands in for CPU-only machines.

The loader yields `HostTensor`s; `transfer_batch_to_device` turns them into `DeviceTensor`s, and everything computed
from them stays one (a tensor subclass propagates through torch operations). On a GPU, reading a `DeviceTensor`
on the host (`.item()`, `.tolist()`, `float()`, ...) is a device synchronisation; reading a `HostTensor` is not.
`ReadSpy` notes every read made while it is active, with the kind of tensor and the module that read it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy")


class HostTensor(torch.Tensor):
    """A tensor as the loader hands it out, in host memory."""


class DeviceTensor(torch.Tensor):
    """A tensor after the batch moved to the device."""


def to_host(batch: Any) -> Any:
    return tuple(t.as_subclass(HostTensor) for t in batch)


def to_device(batch: Any) -> Any:
    return tuple(t.as_subclass(DeviceTensor) for t in batch)


class ReadSpy:
    """Notes `(kind, method, reading module, mark)` for every host read while active; `mark` is set by the caller."""

    def __init__(self) -> None:
        self.active = False
        self.mark: Any = None
        self.reads: list[tuple[str, str, str, Any]] = []
        self._originals: dict[str, Any] = {}

    def install(self) -> None:
        for name in READS:
            self._originals[name] = original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(name, original))

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)

    def _wrap(self, name: str, original: Any) -> Any:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if self.active and not caller.startswith("torch."):  # not the subclass's own dispatch of the same read
                kind = "other"
                if isinstance(tensor, (DeviceTensor, HostTensor)):
                    kind = "device" if isinstance(tensor, DeviceTensor) else "host"
                self.reads.append((kind, name, caller, self.mark))
            return original(tensor, *args, **kwargs)

        return read
