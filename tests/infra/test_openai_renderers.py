"""Rendering a request's chunks as OpenAI objects: the stream's order of deltas, the whole
response, usage, and log-probabilities in each endpoint's form."""

from __future__ import annotations

import json
import math

from infra.gateway_backend import GenerationChunk
from infra.openai_renderers import NEG_INF_LOGPROB, ChatRenderer, CompletionRenderer
from infra.openai_responses import Usage
from wire import TokenLogprobs


def chunk(text: str, finished: bool = False, **counts) -> GenerationChunk:
    return GenerationChunk(request_id="r", text=text, token_ids=(1,), finish_reason="length" if finished else None,
                           num_prompt_tokens=counts.get("p", 3), num_completion_tokens=counts.get("o", 1))


def test_chat_renderer_streams_role_then_content_then_finish():
    renderer = ChatRenderer(request_id="chatcmpl-1", model="acme/m", created=5)
    first = [o.model_dump(mode="json") for o in renderer.stream_objects(chunk("He"), is_first=True)]
    assert [c["choices"][0]["delta"] for c in first] == [{"role": "assistant", "content": ""}, {"content": "He"}]
    assert first[0]["object"] == "chat.completion.chunk" and first[0]["usage"] is None
    assert renderer.stream_objects(chunk(""), is_first=False) == []  # half a UTF-8 character: nothing yet
    (last,) = [o.model_dump(mode="json") for o in renderer.stream_objects(chunk("", finished=True), False)]
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    usage = renderer.usage_object(Usage.of(3, 2)).model_dump(mode="json")
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                                         "total_tokens": 5}


def test_completion_renderer_whole_response():
    renderer = CompletionRenderer(request_id="cmpl-1", model="acme/m", created=5)
    body = renderer.whole("abc", "stop", Usage.of(4, 3)).model_dump(mode="json")
    assert body == {
        "id": "cmpl-1", "object": "text_completion", "created": 5, "model": "acme/m",
        "choices": [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
    }


def entry(token_id: int, token: str, logprob: float, top: tuple[tuple[str, float], ...] = ()) -> TokenLogprobs:
    return TokenLogprobs(token_id=token_id, token=token, logprob=logprob,
                         top_token_ids=tuple(range(100, 100 + len(top))), top_tokens=tuple(t for t, _ in top),
                         top_logprobs=tuple(lp for _, lp in top))


def test_completion_logprobs_stream_with_offsets_across_chunks():
    renderer = CompletionRenderer(request_id="cmpl-1", model="acme/m", created=5)
    first = GenerationChunk(request_id="r", text="He", token_ids=(1,), finish_reason=None, num_prompt_tokens=3,
                            num_completion_tokens=1, logprobs=(entry(1, "He", -0.5, (("He", -0.5), ("A", -2.0))),))
    second = GenerationChunk(request_id="r", text="llo", token_ids=(2,), finish_reason="stop", num_prompt_tokens=3,
                             num_completion_tokens=2, logprobs=(entry(2, "llo", -math.inf, (("x", -0.1), ("llo", -math.inf))),))
    (a,) = renderer.stream_objects(first, True)
    (b,) = renderer.stream_objects(second, False)
    assert a.model_dump(mode="json")["choices"][0]["logprobs"] == {
        "tokens": ["He"], "token_logprobs": [-0.5], "top_logprobs": [{"He": -0.5, "A": -2.0}], "text_offset": [0]}
    assert b.model_dump(mode="json")["choices"][0]["logprobs"] == {
        "tokens": ["llo"], "token_logprobs": [NEG_INF_LOGPROB], "top_logprobs": [{"x": -0.1, "llo": NEG_INF_LOGPROB}],
        "text_offset": [2]}
    json.loads(b.model_dump_json())  # valid JSON: no -Infinity


def test_a_token_with_logprobs_but_no_text_yet_is_still_sent():
    renderer = ChatRenderer(request_id="chatcmpl-1", model="acme/m", created=5)
    half = GenerationChunk(request_id="r", text="", token_ids=(7,), finish_reason=None, num_prompt_tokens=3,
                           num_completion_tokens=1, logprobs=(entry(7, "\ufffd", -1.0),))
    (_, obj) = renderer.stream_objects(half, True)
    choice = obj.model_dump(mode="json")["choices"][0]
    assert choice["delta"] == {} and choice["logprobs"]["content"] == [
        {"token": "\ufffd", "logprob": -1.0, "bytes": [239, 191, 189], "top_logprobs": []}]


def test_chat_whole_response_with_logprobs():
    renderer = ChatRenderer(request_id="chatcmpl-1", model="acme/m", created=5)
    body = renderer.whole("Hé", "stop", Usage.of(2, 2), [entry(1, "H", -0.25, (("H", -0.25),)),
                                                         entry(2, "é", -1.5, (("e", -0.5),))]).model_dump(mode="json")
    assert body["choices"][0]["logprobs"] == {"content": [
        {"token": "H", "logprob": -0.25, "bytes": [72], "top_logprobs": [{"token": "H", "logprob": -0.25, "bytes": [72]}]},
        {"token": "é", "logprob": -1.5, "bytes": [195, 169], "top_logprobs": [{"token": "e", "logprob": -0.5, "bytes": [101]}]},
    ], "refusal": None}
    assert renderer.whole("x", "stop", Usage.of(1, 1)).model_dump(mode="json")["choices"][0]["logprobs"] is None


def test_usage_shows_cached_prompt_tokens_only_when_the_cache_served_some():
    assert Usage.of(10, 2).model_dump(mode="json") == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    assert Usage.of(10, 2, 8).model_dump(mode="json") == {
        "prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 8}}
