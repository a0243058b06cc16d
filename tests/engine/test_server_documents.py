"""Squid documents on the server: the `documents` / `prefix` extension of completions, documents
and document parts in chat, cached document tokens in usage, streaming, n > 1, and bad input
(each a 400 naming the field, the server serving on)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from server_fixture import LiveServer

from cuttle.engine import LLM, SamplingParams

KW = dict(dtype="float32", num_kv_blocks=256, max_model_len=256, squid_positions="shared", max_documents=4)
GREEDY = dict(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def live(qwen3_path):
    with LiveServer(qwen3_path, **KW) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(qwen3_path):
    return LLM(qwen3_path, **KW)


@pytest.fixture()
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none")


def docs(seed: int, lengths: list[int]) -> list[list[int]]:
    """Token-id documents no other test uses (so the cache starts cold for each test)."""
    return [[3 + (seed * 31 + i * 7 + j * 13) % 250 for j in range(n)] for i, n in enumerate(lengths)]


def post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(live.url + path, json=body, timeout=60)


def events(r: httpx.Response) -> list[dict]:
    lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", r.text[-300:]
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_completion_with_documents_equals_offline_and_reuses_them(live, offline, client):
    prefix, (a, b, c) = [7, 8, 9], docs(1, [20, 37, 16])  # 37: not a multiple of the block size
    r = client.completions.create(model="test-model", prompt=[40, 41, 42], max_tokens=10, temperature=0,
                                  extra_body={"documents": [a, b, c], "prefix": prefix, "ignore_eos": True, "return_token_ids": True})
    want = offline.generate({"prefix": prefix, "documents": [a, b, c], "prompt": [40, 41, 42]},
                            SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert r.choices[0].model_extra["token_ids"] == want.outputs[0].token_ids
    assert r.choices[0].text == want.outputs[0].text
    assert r.usage.prompt_tokens == 3 + 20 + 37 + 16 + 3
    assert r.usage.prompt_tokens_details.model_extra["cached_document_tokens"] == 0  # computed now
    computed = live.stats()["documents_computed"]

    # the same documents in another order: nothing computed again, all reported as cached
    again = client.completions.create(model="test-model", prompt=[40, 41, 42], max_tokens=10, temperature=0,
                                      extra_body={"documents": [c, a, b], "prefix": prefix, "ignore_eos": True, "return_token_ids": True})
    assert live.stats()["documents_computed"] == computed
    details = again.usage.prompt_tokens_details
    assert details.model_extra["cached_document_tokens"] == 3 + 20 + 37 + 16
    assert details.cached_tokens >= details.model_extra["cached_document_tokens"]
    assert again.choices[0].model_extra["token_ids"] == want.outputs[0].token_ids  # shared: order-invariant

    # /metrics mirrors the engine's squid counters
    stats, text = live.stats(), httpx.get(live.url + "/metrics").text
    for name, outcome, key in [("documents", "hit", "documents_hit"), ("documents", "computed", "documents_computed"),
                               ("document_tokens", "reused", "document_tokens_reused"),
                               ("document_tokens", "computed", "document_tokens_computed")]:
        line = f'cuttle_squid_{name}_total{{model_name="test-model",outcome="{outcome}"}} {float(stats[key])}'
        assert line in text, line
    assert stats["document_tokens_reused"] >= 3 + 20 + 37 + 16

    # text documents and several prompts (each a query over the same documents)
    texts = ["a b c d e f", "x y z"]
    multi = client.completions.create(model="test-model", prompt=["p q", "r s t"], max_tokens=6, temperature=0,
                                      extra_body={"documents": texts, "ignore_eos": True})
    ref = offline.generate([{"documents": texts, "prompt": p} for p in ("p q", "r s t")],
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [ch.text for ch in sorted(multi.choices, key=lambda ch: ch.index)] == [o.outputs[0].text for o in ref]


def test_documents_with_n_samples_share_the_documents(live):
    d = docs(2, [25, 30])
    before = live.stats()["documents_computed"]
    r = post(live, "/v1/completions", {"prompt": [50, 51], "documents": d, "n": 3, "seed": 5, "temperature": 1.0,
                                        "max_tokens": 8, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert sorted(ch["index"] for ch in body["choices"]) == [0, 1, 2]
    assert len({ch["text"] for ch in body["choices"]}) > 1
    assert body["usage"]["completion_tokens"] == 24 and body["usage"]["prompt_tokens"] == 57
    assert live.stats()["documents_computed"] == before + 2  # once for the group, not per sample


def test_streaming_with_documents(live):
    d = docs(3, [18, 22])
    body = {"prompt": [60, 61, 62], "documents": d, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = post(live, "/v1/completions", body).json()
    evs = events(post(live, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}))
    assert "".join(ch["text"] for e in evs for ch in e["choices"]) == whole["choices"][0]["text"]
    assert [t for e in evs for ch in e["choices"] for t in ch["token_ids"]] == whole["choices"][0]["token_ids"]
    usage = evs[-1]["usage"]
    assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_document_tokens"] == 18 + 22  # the second use

    chat = {"messages": [{"role": "user", "content": [{"type": "document", "name": "m.py", "text": "k = 2"},
                                                      {"type": "text", "text": "a b"}]}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    text = post(live, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    evs = events(post(live, "/v1/chat/completions", {**chat, "stream": True}))
    assert "".join(ch["delta"].get("content", "") for e in evs for ch in e["choices"]) == text


def test_chat_documents_follow_the_system_prompt(live, offline, client):
    """Document parts leave their message and sit after the rendered system message (the prefix),
    each shown as a `# name` line and its text; the rest of the conversation is the query."""
    tok = offline.engine.tokenizer
    system = {"role": "system", "content": "you read files"}
    parts = [{"type": "document", "name": "pkg/util.py", "text": "def f ( x ) : return x"},
             {"type": "text", "text": "what does f do"},
             {"type": "document", "name": "pkg/main.py", "text": "print ( f ( 1 ) )\n"}]
    r = client.chat.completions.create(model="test-model", messages=[system, {"role": "user", "content": parts}], max_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True, "documents": ["z z z"]})
    head = tok.apply_chat_template([system], add_generation_prompt=False)
    full = tok.apply_chat_template([system, {"role": "user", "content": "what does f do"}], add_generation_prompt=True)
    assert full.startswith(head)
    layout = {"prefix": tok.encode(head, add_special_tokens=False),
              "documents": [tok.encode(t, add_special_tokens=False) for t in
                            ("z z z", "# pkg/util.py\ndef f ( x ) : return x\n", "# pkg/main.py\nprint ( f ( 1 ) )\n")],
              "prompt": tok.encode(full[len(head):], add_special_tokens=False)}
    want = offline.generate(layout, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.prompt_tokens_details.model_extra["cached_document_tokens"] == 0
    computed = live.stats()["documents_computed"]

    # the agent's next turn: the same files, in another order, after more conversation
    turn2 = [system, {"role": "user", "content": [parts[2], parts[0], {"type": "text", "text": "and main"}]}]
    r2 = client.chat.completions.create(model="test-model", messages=turn2, max_tokens=4, temperature=0,
                                        extra_body={"documents": ["z z z"]})
    assert live.stats()["documents_computed"] == computed
    assert r2.usage.prompt_tokens_details.model_extra["cached_document_tokens"] == sum(len(d) for d in layout["documents"]) + len(layout["prefix"])


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"documents": [""]}, "documents"),
    ("/v1/completions", {"documents": [[]]}, "documents"),
    ("/v1/completions", {"documents": [[5] * 300]}, "documents"),  # one document over max_model_len
    ("/v1/completions", {"documents": [[5] * 200, [6] * 200], "prompt": [7] * 60}, "documents"),  # the layout over it
    ("/v1/completions", {"documents": [[5]] * 5}, "documents"),  # max_documents is 4
    ("/v1/completions", {"documents": [[5, 6]], "echo": True, "logprobs": 1}, "documents"),  # prompt logprobs
    ("/v1/completions", {"documents": "abc"}, "documents"),
    ("/v1/completions", {"documents": [1.5]}, "documents"),
    ("/v1/completions", {"documents": [[5, 9999]]}, "documents"),
    ("/v1/completions", {"documents": [[5]], "prefix": 5}, "prefix"),
    ("/v1/completions", {"documents": [[5]], "prefix": [9999]}, "prefix"),
    ("/v1/completions", {"documents": [[5]], "max_tokens": 254}, "max_tokens"),  # 1 + 2 + 254 positions > 256
    ("/v1/chat/completions", {"documents": [""]}, "documents"),
    ("/v1/chat/completions", {"documents": [[5]] * 5}, "documents"),
    ("/v1/chat/completions", {"prefix": "sys"}, "prefix"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "document", "text": ""}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "document", "name": 3, "text": "x"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "document", "text": "x", "path": "a"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"},
                                           {"role": "assistant", "content": [{"type": "document", "text": "x"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "document", "text": "x"}] * 5}]}, "messages"),
])
def test_bad_documents_are_400s_naming_the_field(live, path, extra, param):
    base = {"messages": [{"role": "user", "content": "a b"}]} if "chat" in path else {"prompt": [5, 6]}
    r = post(live, path, {**base, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    ok = post(live, path, {**base, "max_tokens": 2, "documents": [[5, 6, 7]]})  # documents keep being served
    assert ok.status_code == 200, ok.text


def test_documents_on_an_mla_model_are_served(tmp_path):
    """DeepSeek-V3 (MLA) takes documents like any model (tests/engine/test_squid_mla.py checks the
    numbers); the server answers them."""
    import torch
    import transformers

    from helpers import write_tokenizer

    cfg = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=512, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(cfg).save_pretrained(str(tmp_path))
    write_tokenizer(str(tmp_path), 256)
    with LiveServer(str(tmp_path), dtype="float32", num_kv_blocks=64, max_model_len=128) as srv:
        r = post(srv, "/v1/completions", {"prompt": [5, 6], "documents": [[7, 8], [9, 10, 11]], "max_tokens": 2,
                                          "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        r = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "document", "text": "x"}]}],
                                               "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        assert post(srv, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}).status_code == 200


def test_nsa_server_serves_documents(tmp_path):
    """Documents to an NSA engine (each document attended by NSA's rules on its own keys,
    docs/nsa.md) are served, with the same tokens as the offline engine."""
    from sparse_helpers import make_nsa_checkpoint

    path = str(tmp_path / "nsa")
    make_nsa_checkpoint(path, seed=5, max_position_embeddings=256)
    body = {"model": "test-model", "prompt": [40, 41, 42], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    docs = [[5, 6, 7, 8] * 9, [9, 10, 11] * 7]
    offline = LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=256).generate(
        [{"documents": docs, "prompt": [40, 41, 42]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    with LiveServer(path, dtype="float32", num_kv_blocks=64, max_model_len=256) as srv:
        r = post(srv, "/v1/completions", {**body, "documents": docs})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        assert r.json()["choices"][0]["text"] == offline
