"""OpenAI's Conversations API (engine/server/conversations.py) and responses that continue one,
through the official `openai` client: a response with `conversation` reads the conversation's
items before its input (the same prompt as sending them all as input: the oracle) and appends its
input and output items; items are created, listed (paged), fetched and deleted as OpenAI's;
whatever would not read as a conversation is refused naming the field."""
from __future__ import annotations

import httpx
import openai
import pytest
from server_fixture import LiveServer, scripted_sampler
from thinking_checkpoint import make_thinking_checkpoint

import cuttle.engine.llm_engine as llm_engine

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
WEATHER = [{"type": "function", "name": "get_weather", "description": "weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    path = make_thinking_checkpoint(str(tmp_path_factory.mktemp("qwen3_conversations")))
    with pytest.MonkeyPatch.context() as mp, LiveServer(path, dtype="float32", num_kv_blocks=512, block_size=4,
                                                        max_model_len=2048) as srv:
        tok = srv.llm.engine.tokenizer
        scripts = {seed: tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
                   for seed, text in {301: CALL, 302: "It is sunny."}.items()}
        mp.setattr(llm_engine, "sample", scripted_sampler(llm_engine.sample, scripts))
        yield srv


@pytest.fixture()
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none")


def test_a_conversation_is_continued_and_extended(client):
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "Hi"},
                                              {"type": "message", "role": "assistant", "content": "Hello!"}],
                                       metadata={"topic": "weather"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "weather"}
    # a tool call, its output sent as the next input, a final answer: each turn continues the conversation
    r1 = client.responses.create(model="test-model", conversation=conv.id, input="Weather in Paris?", tools=WEATHER,
                                 extra_body={"seed": 301})
    [call] = [i for i in r1.output if i.type == "function_call"]
    assert r1.conversation.id == conv.id
    r2 = client.responses.create(model="test-model", conversation={"id": conv.id}, tools=WEATHER, extra_body={"seed": 302},
                                 input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert r2.output_text == "It is sunny."
    items = client.conversations.items.list(conv.id, order="asc", limit=100).data
    assert [i.type for i in items] == ["message", "message", "message", "function_call", "function_call_output", "message"]
    assert items[3].call_id == call.call_id and items[-1].content[0].text == "It is sunny."
    # the oracle: the same items sent whole as one response's input give the same prompt
    whole = client.responses.create(model="test-model", tools=WEATHER, extra_body={"seed": 302}, store=False,
                                    input=[i.model_dump(exclude_none=True) for i in items[:-1]])
    assert whole.usage.input_tokens == r2.usage.input_tokens and whole.output_text == r2.output_text
    # paging, one item, delete one, metadata
    page = client.conversations.items.list(conv.id, limit=2)  # newest first
    assert [i.id for i in page.data] == [items[-1].id, items[-2].id] and page.has_more
    assert client.conversations.items.retrieve(items[1].id, conversation_id=conv.id).id == items[1].id
    assert client.conversations.update(conv.id, metadata={"topic": "done"}).metadata == {"topic": "done"}
    added = client.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "Thanks"}])
    assert len(added.data) == 1 and client.conversations.items.list(conv.id, limit=1).data[0].id == added.data[0].id
    client.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
    assert len(client.conversations.items.list(conv.id, limit=100).data) == 6
    assert client.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)


def test_what_would_not_read_as_a_conversation_is_refused(client, live):
    conv = client.conversations.create()
    assert client.conversations.items.list(conv.id).data == []
    with pytest.raises(openai.BadRequestError) as e:  # an output answering no call
        client.conversations.items.create(conv.id, items=[{"type": "function_call_output", "call_id": "call_x", "output": "1"}])
    assert e.value.body["param"] == "items"
    with pytest.raises(openai.BadRequestError) as e:
        client.conversations.create(items=[{"type": "message", "role": "user", "content": str(i)} for i in range(21)])
    assert e.value.body["param"] == "items"
    with pytest.raises(openai.BadRequestError) as e:
        client.conversations.create(metadata={f"k{i}": "v" for i in range(17)})
    assert e.value.body["param"] == "metadata"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="test-model", conversation=conv.id, previous_response_id="resp_x", input="x")
    assert e.value.body["param"] == "conversation"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="test-model", conversation="conv_nope", input="x")
    assert e.value.body["param"] == "conversation"
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve("msg_nope", conversation_id=conv.id)
    # deleting the call a later output answers would leave the output answering nothing: refused
    r = client.responses.create(model="test-model", conversation=conv.id, input="Weather?", tools=WEATHER, extra_body={"seed": 301})
    [call] = [i for i in r.output if i.type == "function_call"]
    client.conversations.items.create(conv.id, items=[{"type": "function_call_output", "call_id": call.call_id, "output": "1"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.conversations.items.delete(call.id, conversation_id=conv.id)
    assert e.value.body["param"] == "item_id"
    bad = httpx.post(f"{live.url}/v1/conversations", json={"items": [], "name": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "name"
