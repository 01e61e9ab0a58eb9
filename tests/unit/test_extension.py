"""The loader extension: a loader's iteration extended for a fit and given back, the loader kept."""

from __future__ import annotations

import pytest
import torch
from pinning import Pins
from torch.utils.data import DataLoader

from lightning_weighted.loaders import extension

PINS = Pins("extension.")
pinned, exercising = PINS.pinned, PINS.exercising


def test_extend_own_state_and_restore_on_a_plain_dataloader() -> None:
    loader = DataLoader(list(range(6)), batch_size=2)
    with exercising("extend", "DataLoader.__class__ assignment"):
        extended = extension.extend(loader, lambda batches: (batch * 10 for batch in batches))
        extension.extend(extended, lambda batches: (batch + 1 for batch in batches), length=lambda: 2)
    pinned("extend", extended is loader and isinstance(loader, DataLoader), "DataLoader", "the same object")
    pinned("extend", type(loader).__name__ == "DataLoader", "DataLoader", "the class keeps its name")
    batches = [batch.tolist() for batch in loader]
    pinned("extend", batches == [[1, 11], [21, 31], [41, 51]], "DataLoader.__iter__", f"stages in order: {batches}")
    pinned("extend", len(loader) == 2, "DataLoader.__len__", "the length given")
    pinned("own_state", extension.own_state(loader) is None, "DataLoader.state_dict", "a plain loader has none")

    with exercising("restore", "DataLoader.__class__ assignment"):
        restored = extension.restore(loader)
    pinned("restore", restored is loader and type(loader) is DataLoader, "DataLoader", "its own class back")
    pinned("restore", extension.extension(loader) is None and len(loader) == 3, "DataLoader", "no extension left")
    pinned("restore", [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]], "DataLoader", "its own iteration")


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata 0.11's, on torch 2.13
def test_extend_own_state_and_restore_on_a_stateful_dataloader_and_a_plain_iterable() -> None:
    from lightning.fabric.utilities.types import _Stateful
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(8))
    loader = StatefulDataLoader(data, batch_size=2)
    extended = extension.extend(loader, lambda batches: (batch * 10 for batch in batches))
    pinned("extend", extended is loader and isinstance(loader, StatefulDataLoader), "StatefulDataLoader")
    # Lightning saves the state of each loader that is `_Stateful` (`CombinedLoader._state_dicts`)
    pinned("extend", isinstance(loader, _Stateful), "lightning.fabric.utilities.types._Stateful")
    own = extension.own_state(loader)
    pinned("own_state", callable(own), "StatefulDataLoader.state_dict", "the loader's own state_dict")
    assert own is not None
    iterator = iter(loader)
    first = [next(iterator).tolist(), next(iterator).tolist()]
    pinned("extend", first == [[0, 10], [20, 30]], "StatefulDataLoader.__iter__", f"the stage ran: {first}")
    with exercising("extend", "StatefulDataLoader.state_dict"):
        state = loader.state_dict()  # no earlier moment set: the loader's own state
    pinned("extend", state == own(), "StatefulDataLoader.state_dict", "the extended state_dict is the loader's")
    resumed = StatefulDataLoader(data, batch_size=2)
    with exercising("extend", "StatefulDataLoader.load_state_dict"):
        resumed.load_state_dict(state)
        rest = [batch.tolist() for batch in resumed]
    pinned("extend", rest == [[4, 5], [6, 7]], "StatefulDataLoader.state_dict", f"the state of 2 batches: {rest}")

    found = extension.extension(loader)
    assert found is not None
    found.state = lambda: {"earlier": 1}  # what Lightning has consumed, as `_loaders.py` sets it
    pinned("extend", loader.state_dict() == {"earlier": 1}, "StatefulDataLoader.state_dict", "the earlier state")
    pinned("own_state", own() != {"earlier": 1}, "StatefulDataLoader.state_dict", "own_state goes past the extension")

    extension.restore(loader)
    pinned("restore", type(loader) is StatefulDataLoader and extension.extension(loader) is None, "StatefulDataLoader")
    pinned("restore", "earlier" not in loader.state_dict(), "StatefulDataLoader.state_dict", "its own again")

    # Any other iterable is wrapped (and given back by `restore`); its state_dict, if any, is read through.
    iterable = [torch.tensor(1), torch.tensor(2)]
    wrapped = extension.extend(iterable, lambda items: (item + 1 for item in items))
    runs = wrapped is not iterable and [int(x) for x in wrapped] == [2, 3] and len(wrapped) == 2
    pinned("extend", runs, "iter() of an iterable", "a wrapped iterable runs its stage")
    pinned("own_state", extension.own_state(wrapped) is None, "state_dict of an iterable", "a list has none")
    pinned("restore", extension.restore(wrapped) is iterable, "iter() of an iterable", "the iterable given back")


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata 0.11's, on torch 2.13
def test_an_extended_stateful_loader_loads_the_state_its_extension_names_in_place_of_the_given_one() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(8))
    source = StatefulDataLoader(data, batch_size=2)
    iterator = iter(source)
    next(iterator)
    own = source.state_dict()  # this rank's: 1 batch consumed
    next(iterator)
    given = source.state_dict()  # another rank's, which Lightning hands every rank: 2 batches consumed

    loader = StatefulDataLoader(data, batch_size=2)
    found = extension.extension(extension.extend(loader))
    assert found is not None and found.load is None
    found.load = lambda state: own if state == given else None  # as `_loaders.py` sets it: this rank's own
    with exercising("extend", "StatefulDataLoader.load_state_dict"):
        loader.load_state_dict(given)
        rest = [batch.tolist() for batch in loader]
    pinned("extend", rest == [[2, 3], [4, 5], [6, 7]], "StatefulDataLoader.load_state_dict", f"own state: {rest}")

    untouched = StatefulDataLoader(data, batch_size=2)
    found = extension.extension(extension.extend(untouched))
    assert found is not None
    found.load = lambda state: None  # no real batch left on this rank: nothing to load
    untouched.load_state_dict(given)
    rest = [batch.tolist() for batch in untouched]
    pinned("extend", rest == [[0, 1], [2, 3], [4, 5], [6, 7]], "StatefulDataLoader.load_state_dict", "nothing loaded")
    extension.restore(loader)
    extension.restore(untouched)


def test_a_wrapped_iterable_reads_its_state_through_its_extension_too() -> None:
    class Stateful(list):
        def __init__(self) -> None:
            super().__init__([1, 2])
            self.loaded: list[object] = []

        def state_dict(self) -> dict[str, int]:
            return {"own": 1}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.loaded.append(state)

    iterable = Stateful()
    wrapped = extension.extend(iterable)
    found = extension.extension(wrapped)
    assert found is not None and wrapped.state_dict() == {"own": 1}
    pinned("own_state", extension.own_state(wrapped) == iterable.state_dict, "state_dict of an iterable", "read")
    found.state = lambda: {"earlier": 1}
    found.load = lambda given: {"mine": 2} if given == {"everyone's": 3} else None
    assert wrapped.state_dict() == {"earlier": 1}
    wrapped.load_state_dict({"everyone's": 3})
    wrapped.load_state_dict({"other": 4})  # nothing to load for it
    assert iterable.loaded == [{"mine": 2}]
    found.state = lambda: None  # no earlier moment: the iterable's own
    assert wrapped.state_dict() == {"own": 1}
