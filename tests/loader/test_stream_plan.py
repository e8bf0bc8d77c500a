"""StreamPlan: layer-ordered aligned layout, chunks that never span layers, manifest round trip."""

import pytest
import torch

from loader import StreamPlan
from loader.stream_plan import TENSOR_ALIGNMENT_BYTES, StreamChunk


def _tensors():
    # Listed out of layer order on purpose: the head first, layer 1 before layer 0.
    return {
        "lm_head.weight": torch.zeros(3, 5, dtype=torch.bfloat16),  # 30 bytes
        "model.layers.1.w": torch.zeros(100, dtype=torch.float32),  # 400 bytes
        "model.embed_tokens.weight": torch.zeros(7, dtype=torch.float32),  # 28 bytes
        "model.layers.0.a": torch.zeros(3, dtype=torch.int8),  # 3 bytes
        "model.layers.0.b": torch.zeros(0, 4, dtype=torch.float16),  # 0 bytes
        "model.norm.weight": torch.tensor(1.0),  # 0-dim, 4 bytes
    }


def test_layout_is_layer_ordered_and_aligned():
    plan = StreamPlan.from_tensors(_tensors(), transfer_id="t", chunk_bytes=128)
    assert plan.num_layers == 2
    assert [(t.name, t.layer, t.offset, t.size) for t in plan.tensors] == [
        ("model.embed_tokens.weight", -1, 0, 28),
        ("model.layers.0.a", 0, 64, 3),
        ("model.layers.0.b", 0, 128, 0),
        ("model.layers.1.w", 1, 128, 400),
        ("lm_head.weight", 2, 576, 30),
        ("model.norm.weight", 2, 640, 4),
    ]
    assert plan.total_bytes == 704 and all(t.offset % TENSOR_ALIGNMENT_BYTES == 0 for t in plan.tensors)


def test_chunks_never_span_layers():
    plan = StreamPlan.from_tensors(_tensors(), transfer_id="t", chunk_bytes=128)
    assert plan.chunks == (
        StreamChunk(-1, 0, 28),
        StreamChunk(0, 64, 64),  # layer 0 ends where its (empty) last tensor starts
        StreamChunk(1, 128, 128), StreamChunk(1, 256, 128), StreamChunk(1, 384, 128), StreamChunk(1, 512, 16),
        StreamChunk(2, 576, 68),
    )
    assert plan.layer_chunk_end == {-1: 1, 0: 2, 1: 6, 2: 7}


def test_views_read_the_tensor_bytes():
    tensors = {"model.layers.0.x": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "lm_head.weight": torch.ones(1)}
    plan = StreamPlan.from_tensors(tensors, transfer_id="t", chunk_bytes=4096)
    buffer = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    for t in plan.tensors:
        buffer[t.offset: t.offset + t.size] = tensors[t.name].reshape(-1).view(torch.uint8)
    for t in plan.tensors:
        view = plan.view(buffer, t)
        assert view.dtype == tensors[t.name].dtype and torch.equal(view, tensors[t.name])


def test_manifest_round_trip():
    plan = StreamPlan.from_tensors(_tensors(), transfer_id="abc", chunk_bytes=4096, num_layers=3)
    again = StreamPlan.from_bytes(plan.to_bytes())
    assert again == plan and again.chunks == plan.chunks and again.num_layers == 3


@pytest.mark.parametrize("data, message", [
    (b"not json", "not valid JSON"),
    (b'{"format": "other", "version": 1}', "format 'other'"),
    (b'{"format": "thaw-stream-plan", "version": 1}', "malformed"),
])
def test_malformed_manifest_raises_value_error(data, message):
    with pytest.raises(ValueError, match=message):
        StreamPlan.from_bytes(data)


def test_inconsistent_manifest_raises_value_error():
    plan = StreamPlan.from_tensors(_tensors(), transfer_id="t", chunk_bytes=4096)
    text = plan.to_bytes().replace(b'"total_bytes":704', b'"total_bytes":10')
    with pytest.raises(ValueError, match="total_bytes"):
        StreamPlan.from_bytes(text)
    text = plan.to_bytes().replace(b'["model.layers.1.w","float32",[100],1,128,400]',
                                   b'["model.layers.1.w","float32",[100],1,128,401]')
    with pytest.raises(ValueError, match="size 401"):
        StreamPlan.from_bytes(text)
