"""Fixtures shared by test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A one-rank gloo process group in this process, for the module's tests (ZeroTrainer needs an
    initialised world); destroyed when the module is done."""
    pytest.importorskip("torch")
    from zerogpu.launch import torch_unavailable_reason

    reason = torch_unavailable_reason()
    if reason:
        pytest.skip(reason)
    import torch.distributed as dist

    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
