"""The matrix's shared items as a LitData data set: written once by ``litdata.optimize``, read by LitData alone.

- :func:`directory` is where the optimized data set of the ids ``0 .. items - 1`` lies: a cache under the system's
  temporary folder keyed by its content (the items, the chunk size, LitData's version, :data:`FORMAT`).
  :func:`ensure` writes it where it is missing, in a child process (``litdata.optimize`` forces the calling
  process's multiprocessing start method and forks a worker), and moves it into place whole, so that a run either
  finds it complete or not at all. A test session writes it once at most; the rank scripts only read it.
- :func:`loader` is the train loader a LitData user builds: a ``StreamingDataset`` over that folder (its
  ``transform`` turns an id into the item ``(x, y, w, id)``, ``matrix.values``), in a ``StreamingDataLoader``.
- :func:`shards` is what each rank of a 2-rank run trains, by LitData's own rules: the same :func:`loader` built
  in this process with LitData's distributed environment set to that rank (``WORLD_SIZE`` and ``GLOBAL_RANK``, which
  LitData reads when it builds the data set, as under a launcher), iterated epoch after epoch without a Trainer.

Run as ``python litdata_items.py DIR ITEMS CHUNK``, this file writes the data set into ``DIR`` (:func:`ensure` does).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

CHUNK = 4  # items per chunk: several chunks, which LitData deals to the ranks
FORMAT = 1  # what an item holds (its id, an int): a change here makes a new cache entry


def directory(items: int, chunk: int = CHUNK) -> Path:
    """Where the optimized data set of ``items`` ids lies (it may not be written yet: :func:`ensure`)."""
    import litdata

    key = f"items{items}-chunk{chunk}-litdata{litdata.__version__}-format{FORMAT}"
    return Path(tempfile.gettempdir()) / "lightning_weighted-litdata" / key


def ensure(items: int, chunk: int = CHUNK) -> Path:
    """The optimized data set of ``items`` ids, written first where it is missing."""
    target = directory(items, chunk)
    if (target / "index.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        done = subprocess.run(
            [sys.executable, __file__, str(scratch / "data"), str(items), str(chunk)],
            capture_output=True, text=True, timeout=300,
            env={k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "GLOBAL_RANK", "RANK", "LOCAL_RANK")},
        )  # fmt: skip
        if done.returncode != 0 or not (scratch / "data" / "index.json").exists():
            raise RuntimeError(f"litdata.optimize failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
        with contextlib.suppress(OSError):  # another session moved its own copy in first: that one stays
            os.rename(scratch / "data", target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if not (target / "index.json").exists():
        raise RuntimeError(f"no optimized data set at {target}")
    return target


def item_values(index: Any, mode: str) -> tuple[Any, Any, Any, Any]:
    """The item of id ``index`` as the matrix's loaders give it: ``(x, y, w, id)`` (``matrix.values``)."""
    import matrix
    import torch

    ids = torch.tensor([int(index)], dtype=torch.long)
    x, y, w = matrix.values(ids, mode)
    return x[0], y[0], w[0], ids[0]


def loader(options: Mapping[str, Any]) -> Any:
    """The train loader of a ``layout="litdata"`` row: ``StreamingDataLoader(StreamingDataset(...))`` as a LitData
    user builds it, inside ``train_dataloader`` (after the process group exists, which LitData reads)."""
    from litdata import StreamingDataLoader, StreamingDataset

    folder = directory(int(options["items"]))
    if not (folder / "index.json").exists():
        raise FileNotFoundError(f"{folder}: the optimized data set is written by the test first (ensure)")
    dataset = StreamingDataset(
        str(folder), shuffle=bool(options["shuffle"]), transform=functools.partial(item_values, mode=options["mode"])
    )
    return StreamingDataLoader(
        dataset, batch_size=int(options["batch_size"]), drop_last=options["drop_last"],
        num_workers=int(options["num_workers"]),
    )  # fmt: skip


@contextlib.contextmanager
def _rank_environment(world_size: int, rank: int) -> Iterator[None]:
    """LitData's distributed environment (``_DistributedEnv.detect``: ``WORLD_SIZE``, ``GLOBAL_RANK``, ``NNODES``)
    set to ``rank`` of ``world_size`` for the block, as a launcher sets it for a rank."""
    names = ("WORLD_SIZE", "GLOBAL_RANK", "NNODES")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update({"WORLD_SIZE": str(world_size), "GLOBAL_RANK": str(rank), "NNODES": "1"})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@functools.lru_cache(maxsize=64)
def _shard(
    items: int, batch_size: int, shuffle: bool, drop_last: bool | None, mode: str, workers: int, world_size: int,
    rank: int, epochs: int,
) -> tuple[tuple[tuple[int, ...], ...], ...]:  # fmt: skip
    options = {"items": items, "batch_size": batch_size, "shuffle": shuffle, "drop_last": drop_last, "mode": mode,
               "num_workers": workers}  # fmt: skip
    with _rank_environment(world_size, rank):
        built = loader(options)
    # one pass per epoch, each to its end, as an uninterrupted run reads the loader (LitData counts its epochs)
    return tuple(tuple(tuple(int(i) for i in batch[3].tolist()) for batch in built) for _ in range(epochs))


def shards(options: Mapping[str, Any], epochs: int, world_size: int = 2) -> list[list[list[list[int]]]]:
    """Each rank's batches of each epoch, by LitData: ``shards(...)[rank][epoch][k]`` the ids of batch ``k``."""
    key = (int(options["items"]), int(options["batch_size"]), bool(options["shuffle"]), options["drop_last"],
           str(options["mode"]), int(options["num_workers"]))  # fmt: skip
    return [
        [[list(batch) for batch in epoch] for epoch in _shard(*key, world_size, rank, epochs)]
        for rank in range(world_size)
    ]


def elastic(options: Mapping[str, Any], epoch: int, taken: set[int], first: int, world: int) -> list[list[list[int]]]:
    """Each of ``world`` ranks' batches of ``epoch`` by LitData's elastic resume, once the ids ``taken`` trained.

    LitData resumes a run of ``first`` ranks from a number of items of its order (``sample_in_epoch``, rounded down
    to whole batches of every rank): each new rank's loader is built under its rank's environment and handed a state
    of that epoch which says ``len(taken)``; a batch whose items all trained already is left out (trained, not
    dealt), and none may hold some of both.
    """
    import copy

    with _rank_environment(first, 0):
        source = loader(options)
        for _ in range(epoch):
            for _ in source:
                pass
        next(iter(source))
        state = copy.deepcopy(source.state_dict())
    state["dataset"]["sample_in_epoch"] = len(taken)
    ranks = []
    for rank in range(world):
        with _rank_environment(world, rank):
            built = loader(options)
            built.load_state_dict(copy.deepcopy(state))
            batches = [[int(i) for i in batch[3].tolist()] for batch in built]
        assert all(set(b) <= taken or not set(b) & taken for b in batches), "LitData resumed inside a batch"
        ranks.append([b for b in batches if not set(b) <= taken])
    return ranks


def _write(output_dir: str, items: int, chunk: int) -> None:
    import litdata

    # "fork": the worker starts from this process, which imports nothing more (a "spawn" takes ~10 s)
    litdata.optimize(
        fn=_identity, inputs=list(range(items)), output_dir=output_dir, chunk_size=chunk, num_workers=1,
        start_method="fork",
    )  # fmt: skip


def _identity(index: int) -> int:
    return index


if __name__ == "__main__":
    _write(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
