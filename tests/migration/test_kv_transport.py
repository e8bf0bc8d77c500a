"""KV blocks survive each transport bit for bit, in every dtype the cache uses, empty ones included;
through Ray the bytes go via the object store and the payload carries only a reference."""

from __future__ import annotations

import asyncio

import pytest
import torch

from migration import InProcessKVTransport, KVPayload, RayObjectKVTransport


def blocks(num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(num_blocks)
    return torch.randn(2, 2, num_blocks, 4, 2, 8, generator=generator).to(dtype)  # [L, 2, n, bs, Hkv, D]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_blocks", [0, 3])
def test_in_process_round_trip(dtype, num_blocks):
    kv = blocks(num_blocks, dtype)
    transport = InProcessKVTransport()
    payload = transport.send(kv)
    assert (payload.shape, payload.dtype, payload.num_blocks) == (tuple(kv.shape), str(dtype)[6:], num_blocks)
    assert payload.num_bytes == kv.numel() * kv.element_size()
    assert torch.equal(asyncio.run(transport.receive(payload)), kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_blocks", [0, 3])
def test_ray_object_round_trip(local_ray, dtype, num_blocks):
    import ray

    kv = blocks(num_blocks, dtype)
    transport = RayObjectKVTransport()
    payload = transport.send(kv)
    assert isinstance(payload.data, ray.ObjectRef) and "data" not in repr(payload)
    received = asyncio.run(transport.receive(payload))
    assert received.dtype == dtype and received.shape == kv.shape and torch.equal(received, kv)


def test_payload_prints_without_its_data():
    payload = KVPayload((2, 2, 1, 4, 2, 8), "float32", torch.zeros(2, 2, 1, 4, 2, 8))
    assert repr(payload) == "KVPayload(shape=(2, 2, 1, 4, 2, 8), dtype='float32')"
