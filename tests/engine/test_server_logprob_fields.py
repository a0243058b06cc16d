"""vLLM's logprob fields on the server. `prompt_logprobs` on /v1/completions (per choice) and
chat (beside the choices): each prompt position's logprob against transformers, the top k equal to
the offline engine's, the shared computation with echo's logprobs cut to each field's k, a
prefix-cache hit giving the same list, and the refusals (streaming, documents, out of range).
`return_tokens_as_token_ids` (request field and server default): tokens named `token_id:N`."""
from __future__ import annotations

import json

import httpx
import pytest

from server_fixture import LiveServer


@pytest.fixture(scope="module")
def live(qwen3_path):
    with LiveServer(qwen3_path, dtype="float32", num_kv_blocks=128, max_model_len=256) as srv:
        yield srv


def post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(live.url + path, json={"model": "test-model", **body}, timeout=60)


def test_completion_prompt_logprobs_match_transformers_and_the_offline_engine(live, checkpoints, qwen3_path):
    from cuttle.engine import LLM, SamplingParams

    ck = checkpoints["qwen3"]
    prompt, hf_plps = ck["prompts"][4], ck["prompt_logprobs"][4]  # 31 tokens
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    r = post(live, "/v1/completions", body)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        own = got[i][str(prompt[i])]
        assert abs(own["logprob"] - hf_plps[i - 1]) <= 1e-4, i
        ranks = sorted(e["rank"] for e in got[i].values())
        assert ranks[:2] == [1, 2] and len(got[i]) <= 3 and all(isinstance(e["decoded_token"], str) for e in got[i].values())
    ref = LLM(qwen3_path, dtype="float32", num_kv_blocks=64).generate(
        [prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2), use_tqdm=False)[0]
    want = [None] + [{str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token} for t, lp in d.items()}
                     for d in ref.prompt_logprobs[1:]]
    assert got == want
    # the same prompt again is a prefix-cache hit: the list is recomputed, not cut short
    assert post(live, "/v1/completions", body).json()["choices"][0]["prompt_logprobs"] == got
    # k = 0: the prompt token alone
    zero = post(live, "/v1/completions", {**body, "prompt_logprobs": 0}).json()["choices"][0]["prompt_logprobs"]
    assert all(list(d) == [str(prompt[i])] for i, d in enumerate(zero) if d is not None)


@pytest.mark.parametrize("lp,plp", [(1, 3), (3, 1)])
def test_echo_logprobs_and_prompt_logprobs_keep_their_own_k(live, checkpoints, lp, plp):
    prompt = checkpoints["qwen3"]["prompts"][2]
    r = post(live, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": lp,
                                       "prompt_logprobs": plp, "n": 2})
    assert r.status_code == 200, r.text
    for ch in r.json()["choices"]:
        tops = ch["logprobs"]["top_logprobs"][1:len(prompt)]  # echo: the prompt's, cut to `logprobs`
        assert all(lp <= len(t) <= lp + 1 for t in tops)
        plps = ch["prompt_logprobs"][1:]
        assert all(plp <= len(d) <= plp + 1 for d in plps) and len(plps) == len(prompt) - 1
        assert all(e["rank"] <= plp or tok == str(prompt[i + 1]) for i, d in enumerate(plps) for tok, e in d.items())


def test_chat_prompt_logprobs_beside_the_choices(live):
    r = post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a b c"}], "max_tokens": 2,
                                            "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    out = r.json()
    plps = out["prompt_logprobs"]
    assert len(plps) == out["usage"]["prompt_tokens"] and plps[0] is None and all(1 <= len(d) <= 2 for d in plps[1:])
    assert "prompt_logprobs" not in post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                                                        "max_tokens": 1}).json()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra,says", [
    ({"prompt_logprobs": 1, "stream": True}, "stream"),
    ({"prompt_logprobs": 1, "documents": ["a b"]}, "documents"),
    ({"prompt_logprobs": 21}, "[0, 20]"),
    ({"prompt_logprobs": -1}, "[0, 20]"),
    ({"prompt_logprobs": "2"}, "[0, 20]"),
])
def test_refusals_name_the_field(live, path, extra, says):
    body = {"messages": [{"role": "user", "content": "a"}]} if "chat" in path else {"prompt": "a"}
    r = post(live, path, {**body, "max_tokens": 1, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt_logprobs" and says in err["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_return_tokens_as_token_ids(live, stream):
    """vLLM's `return_tokens_as_token_ids`: logprobs name tokens `token_id:N` (completions'
    tokens and top_logprobs keys, chat's token fields), the same logprobs as by text."""
    def completion(as_ids):
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "logprobs": 2, "ignore_eos": True, "stream": stream,
                "return_token_ids": True, **({"return_tokens_as_token_ids": as_ids} if as_ids is not None else {})}
        r = post(live, "/v1/completions", body)
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()["choices"][0]
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        ids: list[int] = []
        for c in chunks:
            for ch in c["choices"]:
                ids += ch.get("token_ids") or []
                for k in lp:
                    lp[k] += (ch["logprobs"] or {}).get(k) or []
        return {"token_ids": ids, "logprobs": lp}

    by_id, by_text, default = completion(True), completion(False), completion(None)
    assert default["logprobs"]["tokens"] == by_text["logprobs"]["tokens"]  # the server's default: text
    assert by_id["logprobs"]["tokens"] == [f"token_id:{t}" for t in by_id["token_ids"]]
    assert by_id["logprobs"]["token_logprobs"] == by_text["logprobs"]["token_logprobs"]
    for tops in by_id["logprobs"]["top_logprobs"]:
        assert tops and all(k.startswith("token_id:") and int(k[9:]) >= 0 for k in tops)
    chat = post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a b"}], "max_tokens": 3, "logprobs": True,
                                               "top_logprobs": 2, "return_tokens_as_token_ids": True, "ignore_eos": True}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(e["token"].startswith("token_id:") for e in content)
    assert all(t["token"].startswith("token_id:") for e in content for t in e["top_logprobs"])
    r = post(live, "/v1/completions", {"prompt": "a", "max_tokens": 1, "return_tokens_as_token_ids": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_tokens_as_token_ids"


def test_server_default_token_ids(qwen3_path):
    with LiveServer(qwen3_path, dtype="float32", num_kv_blocks=32, max_model_len=64,
                    app_kw={"return_tokens_as_token_ids": True}) as srv:
        r = post(srv, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "logprobs": 0, "return_token_ids": True})
        ch = r.json()["choices"][0]
        assert ch["logprobs"]["tokens"] == [f"token_id:{t}" for t in ch["token_ids"]]
        off = post(srv, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "logprobs": 0, "return_tokens_as_token_ids": False})
        assert not any(t.startswith("token_id:") for t in off.json()["choices"][0]["logprobs"]["tokens"])


def test_echo_with_max_tokens_zero_scores_the_prompt(live, checkpoints):
    """vLLM's scoring idiom (`echo`, `logprobs`, `max_tokens: 0`): the prompt and its logprobs
    alone, streamed or not; without echo, max_tokens 0 is refused naming the field."""
    ck = checkpoints["qwen3"]
    prompt, hf_plps = ck["prompts"][3], ck["prompt_logprobs"][3]
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "return_token_ids": True, "n": 2, "temperature": 1.0}
    r = post(live, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    text = _decode(live, prompt)
    assert len(out["choices"]) == 2
    for ch in out["choices"]:
        assert ch["text"] == text and ch["finish_reason"] == "length" and ch["token_ids"] == []
        lp = ch["logprobs"]
        assert len(lp["tokens"]) == len(prompt) and lp["token_logprobs"][0] is None
        assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], hf_plps)) <= 1e-4
    assert out["usage"]["prompt_tokens"] == len(prompt) and out["usage"]["completion_tokens"] == 2  # one dropped token each
    s = post(live, "/v1/completions", {**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in s.text.splitlines() if line.startswith("data: {")]
    got: dict[int, dict] = {}
    for c in chunks:
        for ch in c["choices"]:
            g = got.setdefault(ch["index"], {"text": "", "token_logprobs": [], "finish": None})
            g["text"] += ch["text"]
            g["token_logprobs"] += (ch["logprobs"] or {}).get("token_logprobs") or []
            g["finish"] = ch["finish_reason"] or g["finish"]
    assert sorted(got) == [0, 1]
    for g in got.values():
        assert g == {"text": text, "token_logprobs": out["choices"][0]["logprobs"]["token_logprobs"], "finish": "length"}
    bad = post(live, "/v1/completions", {"prompt": prompt, "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens" and "echo" in bad.json()["error"]["message"]


def _decode(live, ids: list[int]) -> str:
    return live.llm.get_tokenizer().decode(ids, False)
