"""Issue 9: the OpenAI-compatible server, exercised with the official ``openai`` client against a real uvicorn
server on 127.0.0.1 (random-weight tiny checkpoint, greedy, small max_tokens).

Every greedy response is compared with the same request run directly on a second engine over the same
checkpoint, so a lost, truncated or mixed-up response shows up as a mismatch.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from bytebound.engine.engine import Engine
from bytebound.sampling import SamplingParams
from bytebound.server.app import create_app, make_server

NAME = "tiny-random"


@pytest.fixture(scope="module")
def ckpt(tiny_random_ckpt):
    return tiny_random_ckpt


@pytest.fixture(scope="module")
def ref(ckpt):
    """A second engine over the same checkpoint: the expected output of every greedy request."""
    return Engine(model=str(ckpt))


class Server:
    """uvicorn (the server ``bytebound serve`` runs) in a background thread on a free port (port 0), stopped at
    teardown."""

    def __init__(self, app):
        self.app = app
        self.server = make_server(app, "127.0.0.1", 0, log_level="warning", lifespan="on")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(300):                      # bounded: 30 s
            if self.server.started:
                break
            time.sleep(0.1)
        assert self.server.started, "uvicorn did not start"
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def srv(ckpt):
    s = Server(create_app(Engine(model=str(ckpt)), served_model_name=NAME, max_queue=16))
    yield s
    s.stop()


def expect(ref, prompt, chat=False, **kw):
    return ref.generate(prompt, SamplingParams(**{"temperature": 0.0, **kw}), chat=chat)[0]


def extra(obj, key):
    return (obj.model_extra or {}).get(key)


# ---- basic endpoints ---------------------------------------------------------------------------------------
def test_models_health_info(srv):
    c = srv.client()
    assert [m.id for m in c.models.list().data] == [NAME]
    card = c.models.retrieve(NAME)          # GET /v1/models/{id}, as OpenAI's SDK asks it
    assert card.id == NAME and extra(card, "max_model_len") == c.models.list().data[0].model_extra["max_model_len"]
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
    assert httpx.head(f"{srv.url}/health").status_code == 200
    info = httpx.get(f"{srv.url}/server_info").json()
    assert info["served_model_name"] == NAME and info["max_queue"] == 16
    man = info["manifest"]
    assert man.get("levers") or man.get("resolutions")        # the start-up manifest is served


def test_default_served_name_is_checkpoint_basename(ckpt, ref):
    app = create_app(ref, max_queue=1)
    assert app.state.served_model_name == ckpt.name


# ---- completions and chat, streaming and not, against the direct engine -----------------------------------
def test_completion_matches_engine(srv, ref):
    want = expect(ref, "The quick brown fox", max_tokens=12)
    r = srv.client().completions.create(model=NAME, prompt="The quick brown fox", max_tokens=12, temperature=0,
                                        extra_body={"return_token_ids": True})
    ch = r.choices[0]
    assert ch.text == want.text and ch.finish_reason == "length" == want.finish_reason
    assert extra(ch, "token_ids") == want.token_ids
    assert r.usage.completion_tokens == len(want.token_ids) == 12
    assert r.usage.prompt_tokens == want.prompt_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    ids = ref.encode_prompt("The quick brown fox")                 # a token-id prompt gives the same answer
    r2 = srv.client().completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0)
    assert r2.choices[0].text == want.text and r2.usage.prompt_tokens == len(ids)


def test_completion_stream_with_usage(srv, ref):
    want = expect(ref, "Once upon a time", max_tokens=10)
    chunks = list(srv.client().completions.create(model=NAME, prompt="Once upon a time", max_tokens=10,
                                                  temperature=0, stream=True,
                                                  stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == want.text and finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_matches_engine(srv, ref):
    want = expect(ref, "How many apples?", chat=True, max_tokens=9)
    msgs = [{"role": "user", "content": "How many apples?"}]
    c = srv.client()
    r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=9, temperature=0)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == want.completion_tokens
    chunks = list(c.chat.completions.create(model=NAME, messages=msgs, max_tokens=9, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == want.completion_tokens
    # max_completion_tokens (newer clients) is honoured too
    r2 = c.chat.completions.create(model=NAME, messages=msgs, max_completion_tokens=3, temperature=0)
    assert r2.usage.completion_tokens == 3


def test_finish_reason_stop_string_and_stop_token(srv, ref):
    full = expect(ref, "Tell me a story", max_tokens=24)
    text = full.text
    cut = next((i for i in range(len(text) // 3, len(text) - 2) if text[i:i + 2].isalpha()), None)
    c = srv.client()
    if cut is not None:
        stop = text[cut:cut + 2]
        want = expect(ref, "Tell me a story", max_tokens=24, stop=(stop,))
        r = c.completions.create(model=NAME, prompt="Tell me a story", max_tokens=24, temperature=0, stop=[stop],
                                 extra_body={"return_token_ids": True})
        ch = r.choices[0]
        assert ch.finish_reason == "stop" == want.finish_reason and stop not in ch.text
        assert ch.text == want.text == text[:text.find(stop)]
        assert r.usage.completion_tokens == len(extra(ch, "token_ids")) == want.completion_tokens
    # a stop token id (extension): the output ends before it, the id is not counted
    k = next(i for i in range(2, len(full.token_ids)) if full.token_ids[i] not in full.token_ids[:i])
    r = c.completions.create(model=NAME, prompt="Tell me a story", max_tokens=24, temperature=0,
                             extra_body={"stop_token_ids": [full.token_ids[k]], "return_token_ids": True})
    assert r.choices[0].finish_reason == "stop"
    assert extra(r.choices[0], "token_ids") == full.token_ids[:k] and r.usage.completion_tokens == k


def _stream_ids(chunks) -> list[int]:
    return [i for c in chunks if c.choices for i in (extra(c.choices[0], "token_ids") or [])]


def test_stream_return_token_ids_match_non_streaming(srv, ref):
    """``return_token_ids`` with ``stream``: every chunk's choice carries the ids of that chunk (chat: next to
    ``delta``), and the chunks' ids concatenated are the non-streaming ``token_ids`` (they used to be dropped).
    Without the flag no chunk has the key."""
    c = srv.client()
    kw = dict(model=NAME, prompt="Once upon a time", max_tokens=10, temperature=0)
    want = c.completions.create(**kw, extra_body={"return_token_ids": True})
    want_ids = extra(want.choices[0], "token_ids")
    assert want_ids == expect(ref, "Once upon a time", max_tokens=10).token_ids and len(want_ids) == 10
    chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True},
                                       extra_body={"return_token_ids": True}))
    assert all(isinstance(extra(ch.choices[0], "token_ids"), list) for ch in chunks if ch.choices)
    assert _stream_ids(chunks) == want_ids
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.choices[0].text
    plain = list(c.completions.create(**kw, stream=True))
    assert not any("token_ids" in (ch.choices[0].model_extra or {}) for ch in plain if ch.choices)

    msgs = [{"role": "user", "content": "How many apples?"}]
    ckw = dict(model=NAME, messages=msgs, max_tokens=9, temperature=0)
    want = c.chat.completions.create(**ckw, extra_body={"return_token_ids": True})
    want_ids = extra(want.choices[0], "token_ids")
    assert want_ids == expect(ref, "How many apples?", chat=True, max_tokens=9).token_ids
    chunks = list(c.chat.completions.create(**ckw, stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and extra(chunks[0].choices[0], "token_ids") == []
    assert _stream_ids(chunks) == want_ids
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want.choices[0].message.content
    plain = list(c.chat.completions.create(**ckw, stream=True))
    assert not any("token_ids" in (ch.choices[0].model_extra or {}) for ch in plain if ch.choices)


def test_stream_return_token_ids_without_text(ckpt):
    """Dummy weights, no tokenizer: every answer's text is empty, so a stream used to send no content chunk at all;
    with ``return_token_ids`` each chunk of new ids is sent (empty text) and the ids add up to the non-streaming
    ones."""
    from fastapi.testclient import TestClient
    eng = Engine(model=str(ckpt / "config.json"), load_format="dummy")
    assert eng.tokenizer is None
    body = {"model": NAME, "prompt": [5, 17, 42, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    with TestClient(create_app(eng, served_model_name=NAME)) as tc:
        r = tc.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        want = r.json()["choices"][0]
        assert want["text"] == "" and len(want["token_ids"]) == 8
        r = tc.post("/v1/completions", json={**body, "stream": True})
        assert r.status_code == 200, r.text
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        got = [i for e in events for i in e["choices"][0]["token_ids"]]
        assert got == want["token_ids"]
        assert all(e["choices"][0]["text"] == "" for e in events)
        assert sum(1 for e in events if e["choices"][0]["token_ids"]) >= 1


# ---- logprobs --------------------------------------------------------------------------------------------------
def _events(r) -> list[dict]:
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _entry(ref, i: int, lp: float) -> dict:
    s = ref.tokenizer.decode([i])
    return {"token": s, "logprob": lp, "bytes": list(s.encode())}


def test_chat_logprobs_openai_shape_streamed_equals_non_streamed(srv, ref):
    """Chat ``logprobs: true`` + ``top_logprobs``: OpenAI's ``{content: [{token, logprob, bytes, top_logprobs}]}``
    with the engine's records; the stream's chunks carry the records of their tokens, concatenated the same."""
    msgs = [{"role": "user", "content": "How many apples?"}]
    want = expect(ref, "How many apples?", chat=True, max_tokens=9, logprobs=3)
    body = {"messages": msgs, "max_tokens": 9, "temperature": 0, "logprobs": True, "top_logprobs": 3,
            "return_token_ids": True}
    r = _post(srv.url, "/v1/chat/completions", body)
    ch = r.json()["choices"][0]
    assert ch["message"]["content"] == want.text and ch["token_ids"] == want.token_ids
    content = ch["logprobs"]["content"]
    assert list(ch["logprobs"]) == ["content"] and len(content) == len(want.token_ids) == 9
    assert content == [_entry(ref, w.token_id, w.logprob) | {"top_logprobs": [_entry(ref, i, lp) for i, lp in w.top]}
                       for w in want.logprobs]
    assert all(len(c["top_logprobs"]) == 3 and c["top_logprobs"][0]["logprob"] == c["logprob"] for c in content)
    events = _events(_post(srv.url, "/v1/chat/completions", {**body, "stream": True}))
    assert events[0]["choices"][0]["logprobs"] is None and events[-1]["choices"][0]["logprobs"] is None
    body_events = [e["choices"][0] for e in events[1:-1]]
    assert all(len(c["logprobs"]["content"]) == len(c["token_ids"]) for c in body_events)
    assert [x for c in body_events for x in c["logprobs"]["content"]] == content
    # the official client parses it; logprobs: true alone gives empty top lists; without it, null
    c = srv.client()
    r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=9, temperature=0, logprobs=True)
    assert [t.logprob for t in r.choices[0].logprobs.content] == [w.logprob for w in want.logprobs]
    assert all(t.top_logprobs == [] for t in r.choices[0].logprobs.content)
    r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=2, temperature=0)
    assert r.choices[0].logprobs is None


def test_completion_logprobs_openai_shape_streamed_equals_non_streamed(srv, ref):
    """Completions ``logprobs`` k: ``{tokens, token_logprobs, top_logprobs, text_offset}`` (top: the k best and the
    chosen token); ``text_offset`` is where each token's text starts in the completion; the streamed chunks'
    records and offsets, concatenated, are the non-streamed ones."""
    want = expect(ref, "Once upon a time", max_tokens=10, logprobs=2)
    body = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "logprobs": 2}
    ch = _post(srv.url, "/v1/completions", body).json()["choices"][0]
    lp = ch["logprobs"]
    assert ch["text"] == want.text and list(lp) == ["tokens", "token_logprobs", "top_logprobs", "text_offset"]
    assert lp["tokens"] == [ref.tokenizer.decode([i]) for i in want.token_ids]
    assert lp["token_logprobs"] == [w.logprob for w in want.logprobs]
    names = ref.tokenizer.decode
    assert lp["top_logprobs"] == [{names([i]): v for i, v in w.top} | {names([w.token_id]): w.logprob}
                                  for w in want.logprobs]
    ids = want.token_ids
    assert lp["text_offset"] == [len(ref.tokenizer.decode(ids[:i])) for i in range(len(ids))]
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] < len(ch["text"])
    events = _events(_post(srv.url, "/v1/completions", {**body, "stream": True}))
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"] is not None]
    assert events[-1]["choices"][0]["logprobs"] is None and len(parts) >= 2
    assert {k: [x for p in parts for x in p[k]] for k in lp} == lp
    c = srv.client().completions.create(model=NAME, prompt="Once upon a time", max_tokens=10, temperature=0,
                                        logprobs=0)
    # k = 0: the chosen token alone in each top_logprobs entry (OpenAI's "up to k + 1", vLLM's form), never null
    assert c.choices[0].logprobs.token_logprobs == lp["token_logprobs"]
    assert c.choices[0].logprobs.top_logprobs == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"])]


def test_logprobs_stay_aligned_with_text_cut_by_a_stop_string(srv, ref):
    """A stop string cuts the tokens after the kept text: the records are those of the returned tokens, one per
    token, streamed or not."""
    text = expect(ref, "Tell me a story", max_tokens=24).text
    cut = next(i for i in range(len(text) // 3, len(text) - 2) if text[i:i + 2].isalpha())
    stop = text[cut:cut + 2]
    want = expect(ref, "Tell me a story", max_tokens=24, stop=(stop,), logprobs=1)
    assert want.finish_reason == "stop" and len(want.token_ids) < 24
    body = {"prompt": "Tell me a story", "max_tokens": 24, "temperature": 0, "stop": [stop], "logprobs": 1,
            "return_token_ids": True}
    ch = _post(srv.url, "/v1/completions", body).json()["choices"][0]
    assert ch["text"] == want.text == text[:cut] and ch["finish_reason"] == "stop"
    assert len(ch["logprobs"]["tokens"]) == len(ch["token_ids"]) == len(want.token_ids)
    assert ch["logprobs"]["token_logprobs"] == [w.logprob for w in want.logprobs]
    assert all(o <= len(ch["text"]) for o in ch["logprobs"]["text_offset"])
    events = _events(_post(srv.url, "/v1/completions", {**body, "stream": True}))
    got = [x for e in events if e["choices"][0]["logprobs"] for x in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert got == ch["logprobs"]["token_logprobs"]
    chat = _post(srv.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story"}],
                                                  "max_tokens": 24, "temperature": 0, "stop": [stop],
                                                  "logprobs": True, "return_token_ids": True}).json()["choices"][0]
    assert len(chat["logprobs"]["content"]) == len(chat["token_ids"])


def test_logprobs_without_a_tokenizer_and_infinite_values(ckpt):
    """No tokenizer (dummy weights): tokens are named ``token_id:N`` and every streamed chunk of ids carries its
    records though its text is empty. A -inf logprob is sent as -9999.0, valid JSON."""
    import math
    from fastapi.testclient import TestClient
    from bytebound.engine.engine import TokenLogprob
    from bytebound.server.app import _Logprobs
    eng = Engine(model=str(ckpt / "config.json"), load_format="dummy")
    body = {"model": NAME, "prompt": [5, 17, 42, 7], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "return_token_ids": True}
    with TestClient(create_app(eng, served_model_name=NAME)) as tc:
        want = tc.post("/v1/completions", json=body).json()["choices"][0]
        assert want["logprobs"]["tokens"] == [f"token_id:{i}" for i in want["token_ids"]]
        assert want["logprobs"]["text_offset"] == [0] * 5
        events = _events(tc.post("/v1/completions", json={**body, "stream": True, "return_token_ids": False}))
        assert [x for e in events if e["choices"][0]["logprobs"] for x in e["choices"][0]["logprobs"]["tokens"]] \
            == want["logprobs"]["tokens"]
    rec = TokenLogprob(7, -math.inf, ((3, -1.5), (7, -math.inf)))
    out = _Logprobs(None).completion([rec])
    assert out["token_logprobs"] == [-9999.0] and out["top_logprobs"] == [{"token_id:3": -1.5, "token_id:7": -9999.0}]
    json.dumps(out, allow_nan=False)
    assert _Logprobs(None).chat([rec])["content"][0]["top_logprobs"][1]["logprob"] == -9999.0


# ---- errors: 4xx, and the server keeps serving ------------------------------------------------------------
BAD = [
    (b'{"model": ', 400), (b"[1, 2]", 400), (b"\xff\xfe", 400),
    ({"model": None, "prompt": "hi"}, 400), ({"model": 7, "prompt": "hi"}, 400),
    ({"model": "no-such-model", "prompt": "hi"}, 404),
    ({"prompt": "hi", "max_tokens": -1}, 400), ({"prompt": "hi", "max_tokens": 0}, 400),
    ({"prompt": "hi", "max_tokens": 10 ** 12}, 400), ({"prompt": "hi", "max_tokens": 5000}, 400),
    ({"prompt": "hi", "max_tokens": "ten"}, 400), ({"prompt": "hi", "max_tokens": 1.5}, 400),
    ({"prompt": "hi", "max_tokens": True}, 400),
    ({"prompt": "hi", "temperature": -0.5}, 400), ({"prompt": "hi", "temperature": 1000}, 400),
    ({"prompt": "hi", "temperature": "hot"}, 400),
    ({"prompt": "hi", "top_p": 0}, 400), ({"prompt": "hi", "top_p": 1.5}, 400), ({"prompt": "hi", "top_p": -1}, 400),
    ({"prompt": "hi", "top_k": -2}, 400), ({"prompt": "hi", "top_k": 2.5}, 400),
    ({"prompt": "hi", "n": 2}, 400), ({"prompt": "hi", "logprobs": 21}, 400), ({"prompt": "hi", "echo": True}, 400),
    ({"prompt": "hi", "logprobs": True}, 400), ({"prompt": "hi", "logprobs": -1}, 400),
    ({"prompt": "hi", "logprobs": "2"}, 400), ({"prompt": "hi", "logprobs": 1, "top_logprobs": 1}, 400),
    ({"prompt": "hi", "prompt_logprobs": 1}, 400), ({"prompt": "hi", "logprobs": 1, "echo": True}, 400),
    ({"prompt": "hi", "presence_penalty": 0.5}, 400), ({"prompt": "hi", "stop": 5}, 400),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400), ({"prompt": "hi", "stream": "yes"}, 400),
    ({"prompt": ""}, 400), ({}, 400), ({"prompt": ["a", "b"]}, 400), ({"prompt": [999999]}, 400),
    ({"prompt": None}, 400), ({"prompt": "hi", "seed": "x"}, 400),
    # vLLM / SGLang sampling extensions not implemented: refused, never silently ignored
    ({"prompt": "hi", "min_tokens": 70}, 400), ({"prompt": "hi", "min_p": 0.5}, 400),
    ({"prompt": "hi", "stop": ["="], "include_stop_str_in_output": True}, 400),
    ({"prompt": "hi", "skip_special_tokens": False}, 400), ({"prompt": "hi", "typical_p": 0.9}, 400),
    ({"prompt": "hi", "guided_choice": ["a", "b"]}, 400), ({"prompt": "hi", "use_beam_search": True}, 400),
    ({"prompt": "hi", "allowed_token_ids": [11, 12]}, 400), ({"prompt": "hi", "bad_words": ["x"]}, 400),
    ({"prompt": "hi", "min_new_tokens": 3}, 400), ({"prompt": "hi", "truncate_prompt_tokens": 2}, 400),
    ({"prompt": "hi", "min_p": False}, 400), ({"prompt": "hi", "typical_p": True}, 400),
]
BAD_CHAT = [({"messages": []}, 400), ({"messages": [{"role": "tool", "content": "x"}]}, 400),
            ({"messages": [{"role": "user", "content": 5}]}, 400), ({"messages": "hi"}, 400),
            ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, 400),
            ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400),
            ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}, 404),
            ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ messages }}"}, 400),
            ({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False}, 400),
            ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400),
            ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
            ({"messages": [{"role": "user", "content": "x"}], "logprobs": False, "top_logprobs": 0}, 400),
            ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, 400),
            ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, 400),
            ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": True}, 400)]


def _post(url, path, body):
    if isinstance(body, dict):
        body = json.dumps({"model": NAME, **body}).encode()
    return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=60)


def test_bad_requests_get_4xx_and_server_keeps_serving(srv, ref):
    for body, status in BAD:
        r = _post(srv.url, "/v1/completions", body)
        assert r.status_code == status, (body, r.status_code, r.text)
        assert "message" in r.json()["error"]
    for body, status in BAD_CHAT:
        r = _post(srv.url, "/v1/chat/completions", body)
        assert r.status_code == status, (body, r.status_code, r.text)
    # the range error names the field the client set, in the message as in param
    r = _post(srv.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                                "top_logprobs": 21})
    err = r.json()["error"]
    assert err["param"] == "top_logprobs" and err["message"].startswith("top_logprobs must be"), err
    c = srv.client()
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="hi", max_tokens=2)
    for kw in ({"max_tokens": -5}, {"max_tokens": 10 ** 9}, {"temperature": 500.0}, {"top_p": 0.0},
               {"max_tokens": 2, "top_p": 2.0}):
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model=NAME, prompt="hi", **{"max_tokens": 2, **kw})
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], temperature=-1)
    assert httpx.get(f"{srv.url}/v1/completions").status_code == 405
    want = expect(ref, "still alive?", max_tokens=4)
    assert c.completions.create(model=NAME, prompt="still alive?", max_tokens=4, temperature=0).choices[0].text \
        == want.text
    # the refused extensions at their neutral values are what the engine does anyway: accepted
    neutral = {"min_tokens": 0, "min_p": 0.0, "typical_p": 1.0, "include_stop_str_in_output": False,
               "skip_special_tokens": True, "use_beam_search": False, "length_penalty": 1.0}
    r = _post(srv.url, "/v1/completions", {"prompt": "still alive?", "max_tokens": 4, "temperature": 0, **neutral})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text
    assert httpx.get(f"{srv.url}/health").status_code == 200


def test_request_without_model_is_for_the_served_model(srv, ref):
    """As vLLM and SGLang: a request that names no model gets the one this server serves (a wrong name stays 404,
    above); a ``model`` that is not a string stays 400."""
    want = expect(ref, "The quick brown fox", max_tokens=5)
    for path, body in (("/v1/completions", {"prompt": "The quick brown fox"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "The quick brown fox"}]})):
        r = httpx.post(srv.url + path, json={**body, "max_tokens": 5, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == NAME
        if path == "/v1/completions":
            assert r.json()["choices"][0]["text"] == want.text
    r = httpx.post(srv.url + "/v1/completions", json={"model": None, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


# ---- load: 200 sequential, 8 concurrent ------------------------------------------------------------------
def test_200_sequential_requests(srv, ref):
    c = srv.client()
    prompts = [f"Request {i}: the number is {i * 7 % 113}" for i in range(200)]
    wants = [expect(ref, p, max_tokens=3) for p in prompts]
    for i, (p, w) in enumerate(zip(prompts, wants)):
        if i % 5 == 4:      # every fifth streams
            chunks = list(c.completions.create(model=NAME, prompt=p, max_tokens=3, temperature=0, stream=True,
                                               stream_options={"include_usage": True}))
            got, n = "".join(ch.choices[0].text for ch in chunks if ch.choices), chunks[-1].usage.completion_tokens
        else:
            r = c.completions.create(model=NAME, prompt=p, max_tokens=3, temperature=0)
            got, n = r.choices[0].text, r.usage.completion_tokens
        assert (got, n) == (w.text, w.completion_tokens), f"request {i} ({p!r})"


def test_8_concurrent_clients(srv, ref):
    jobs = {(t, j): f"Thread {t} asks question {j} about {t * 31 + j}" for t in range(8) for j in range(3)}
    wants = {k: expect(ref, p, chat=(k[1] == 1), max_tokens=6) for k, p in jobs.items()}
    got, errors = {}, []
    start = threading.Barrier(8)

    def client_thread(t):
        c = srv.client()
        try:
            start.wait(timeout=30)
            for j in range(3):
                p = jobs[(t, j)]
                if j == 0:
                    got[(t, j)] = c.completions.create(model=NAME, prompt=p, max_tokens=6, temperature=0).choices[0].text
                elif j == 1:
                    chunks = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": p}],
                                                       max_tokens=6, temperature=0, stream=True)
                    got[(t, j)] = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                else:
                    chunks = c.completions.create(model=NAME, prompt=p, max_tokens=6, temperature=0, stream=True)
                    got[(t, j)] = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        except Exception as e:          # reported below with the thread's id
            errors.append((t, repr(e)))

    threads = [threading.Thread(target=client_thread, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors
    assert got == {k: w.text for k, w in wants.items()}


# ---- queue limit (429) and client-disconnect cancellation -------------------------------------------------
def _metric(url, name, labels=""):
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + labels + " ") or (not labels and line.startswith(name + " ")):
            return float(line.split()[-1])
    return 0.0


def _wait(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_queue_full_429_and_disconnect_cancels(ckpt, ref):
    s = Server(create_app(Engine(model=str(ckpt)), served_model_name=NAME, max_queue=1))
    try:
        long = {"model": NAME, "prompt": "long one", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
        with httpx.Client(timeout=60) as hc:
            # A: a long stream occupies the engine
            with hc.stream("POST", f"{s.url}/v1/completions", json={**long, "stream": True}) as ra:
                assert ra.status_code == 200
                lines = ra.iter_lines()
                assert next(ln for ln in lines if ln.startswith("data: "))
                # X: queued, then its client gives up: its place is free at once (it used to hold it, and so 429
                # others, until the dispatcher reached it)
                with pytest.raises(httpx.ReadTimeout):
                    hc.post(f"{s.url}/v1/completions", json={**long, "max_tokens": 2}, timeout=0.3)
                assert _wait(lambda: httpx.get(f"{s.url}/server_info").json()["queued"] == 0)
                assert _metric(s.url, "bytebound_num_queued_requests") == 0          # the gauge agrees
                assert httpx.get(f"{s.url}/server_info").json()["running"]          # A still holds the engine
                # B: waits in the queue (the only slot)
                box = {}
                tb = threading.Thread(target=lambda: box.setdefault("b", _post(s.url, "/v1/completions",
                                                                               {"prompt": "queued", "max_tokens": 4,
                                                                                "temperature": 0})))
                tb.start()
                assert _wait(lambda: httpx.get(f"{s.url}/server_info").json()["queued"] == 1)
                # C: queue full -> 429 (raw and through the client)
                rc = _post(s.url, "/v1/completions", {"prompt": "rejected", "max_tokens": 2})
                assert rc.status_code == 429 and rc.headers.get("retry-after") == "1"
                with pytest.raises(openai.RateLimitError):
                    s.client().completions.create(model=NAME, prompt="rejected", max_tokens=2)
            # leaving the block closes A's connection: its generation must stop at the next token
            tb.join(timeout=60)
            assert not tb.is_alive()
            want = expect(ref, "queued", max_tokens=4)
            assert box["b"].status_code == 200 and box["b"].json()["choices"][0]["text"] == want.text
            assert _wait(lambda: _metric(s.url, "bytebound_requests_total", '{finish_reason="cancelled"}') == 2)
            gen_after_a = _metric(s.url, "bytebound_generation_tokens_total")
            assert gen_after_a < 3000 + 4, "the disconnected stream was not cancelled"
            # D: a non-streaming client that gives up (timeout) is cancelled too
            with pytest.raises(httpx.ReadTimeout):
                hc.post(f"{s.url}/v1/completions", json=long, timeout=1.0)
            assert _wait(lambda: _metric(s.url, "bytebound_requests_total", '{finish_reason="cancelled"}') == 3)
            assert _metric(s.url, "bytebound_generation_tokens_total") < gen_after_a + 3000
            assert _metric(s.url, "bytebound_requests_rejected_total", '{reason="queue_full"}') == 2
            # and the server still serves
            r = _post(s.url, "/v1/completions", {"prompt": "queued", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text
    finally:
        s.stop()


# ---- metrics -------------------------------------------------------------------------------------------------
def test_metrics(srv):
    srv.client().completions.create(model=NAME, prompt="metrics please", max_tokens=5, temperature=0)
    text = httpx.get(f"{srv.url}/metrics").text
    for name in ("bytebound_time_per_output_token_seconds_bucket", "bytebound_time_to_first_token_seconds_bucket",
                 "bytebound_spec_accept_length", "bytebound_prompt_tokens_total",
                 "bytebound_generation_tokens_total", "bytebound_e2e_request_latency_seconds_count"):
        assert name in text, name
    assert _metric(srv.url, "bytebound_time_per_output_token_seconds_count") >= 1
    assert _metric(srv.url, "bytebound_generation_tokens_total") >= 5


def test_untokenizable_prompt_and_huge_seed_are_400(srv):
    import httpx
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        name = NAME
        r = c.post("/v1/completions", content='{"model": "%s", "prompt": "\\ud800", "max_tokens": 2}' % name,
                   headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        r = c.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2, "temperature": 1.0,
                                            "seed": 99999999999999999999999})
        assert r.status_code == 400, r.text
        assert c.get("/health").status_code == 200


def test_lone_surrogate_is_400_naming_the_field(srv, ref):
    """A lone UTF-16 surrogate (JSON "\\ud800" without its pair) is not valid Unicode: the 400 says so and names
    the field and message, not the tokenizer's TypeError; the server then serves the next request."""
    cases = [("/v1/completions", {"prompt": "ab\ud800", "max_tokens": 2}, "prompt", "'prompt'"),
             ("/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"},
                                                    {"role": "user", "content": "x\udfffy"}], "max_tokens": 2},
              "messages", "messages[1].content"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
                 {"type": "text", "text": "fine"}, {"type": "text", "text": "\udbff"}]}], "max_tokens": 2},
              "messages", "messages[0].content[1].text"),
             ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": ["ok", "\ud83d"]}, "stop", "stop[1]")]
    before = _errors(srv.url).get(("400", "invalid_unicode"), 0.0)
    for path, body, param, where in cases:
        raw = json.dumps({"model": NAME, **body}).encode()        # ensure_ascii: the surrogate travels as \uXXXX
        assert b"\\ud" in raw
        e = _err(_post(srv.url, path, raw), 400, param, "invalid_unicode")
        assert e["type"] == "invalid_request_error"
        assert where in e["message"] and "lone UTF-16 surrogate" in e["message"], e
        assert "TypeError" not in e["message"], e
    assert _errors(srv.url)[("400", "invalid_unicode")] == before + len(cases)
    # a valid surrogate pair (an emoji as ensure_ascii writes it) is one character and fine
    assert _post(srv.url, "/v1/completions", b'{"model": "%s", "prompt": "hi \\ud83d\\ude00", "max_tokens": 2}'
                 % NAME.encode()).status_code == 200
    want = expect(ref, "still serving", max_tokens=3)
    r = _post(srv.url, "/v1/completions", {"prompt": "still serving", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text


# ---- tester's findings: each bad request gets a 4xx OpenAI-style error naming the problem ------------------
def _err(r, status, param="-", code="-"):
    assert r.status_code == status, (r.status_code, r.text)
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"], e
    assert param == "-" or e["param"] == param, e
    assert code == "-" or e["code"] == code, e
    return e


def test_deeply_nested_or_huge_json_is_400(srv):
    deep = b'{"model":"%s","prompt":"hi","x":' % NAME.encode() + b"[" * 1200 + b"]" * 1200 + b"}"
    assert "malformed JSON" in _err(_post(srv.url, "/v1/completions", deep), 400)["message"]
    # an integer over Python's digit limit (ValueError, not JSONDecodeError) and one too big for a float
    _err(_post(srv.url, "/v1/completions", b'{"prompt": "hi", "seed": 1%s}' % (b"0" * 5000)), 400)
    _err(_post(srv.url, "/v1/completions", {"prompt": "hi", "temperature": 10 ** 400}), 400, "temperature")
    # nested just within the server's limit: the validation error's repr of it must not recurse either
    from bytebound.server.app import MAX_JSON_DEPTH
    d = MAX_JSON_DEPTH - 1
    body = b'{"model":"%s","prompt":"hi","logit_bias":' % NAME.encode() + b"[" * d + b"1" + b"]" * d + b"}"
    assert "logit_bias" in _err(_post(srv.url, "/v1/completions", body), 400)["message"]
    # the depth limit does not depend on the process's recursion limit (torch.compile raises it to 2000)
    import sys
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(5000)
    try:
        assert "nested deeper" in _err(_post(srv.url, "/v1/completions", deep), 400)["message"]
    finally:
        sys.setrecursionlimit(old)
    # brackets inside strings are text, not nesting
    assert _post(srv.url, "/v1/completions", {"prompt": "[" * 2000, "max_tokens": 1}).status_code == 200
    assert httpx.get(f"{srv.url}/health").status_code == 200


def test_overlong_chat_prompt_without_max_tokens_is_context_length_exceeded(srv):
    long = "hello " * 5000
    e = _err(_post(srv.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}), 400,
             "messages", "context_length_exceeded")
    assert "max_tokens" not in e["message"]           # the client sent none
    _err(_post(srv.url, "/v1/completions", {"prompt": long}), 400, "prompt", "context_length_exceeded")
    # a prompt that fits with a limit that does not: the limit is the culprit
    _err(_post(srv.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_completion_tokens": 5000}),
         400, "max_completion_tokens", "context_length_exceeded")


def test_prompt_longer_than_the_context_says_the_prompt_does_not_fit(srv, ref):
    """A prompt that alone exceeds max_model_len: the message names its length and the limit and says the prompt
    itself does not fit (not "room for at most 0 new tokens", nor the max_tokens no value of which would help)."""
    long = "hello " * 5000
    n, limit = len(ref.encode_prompt(long)), httpx.get(f"{srv.url}/server_info").json()["max_model_len"]
    assert n > limit
    for path, body, param in (("/v1/completions", {"prompt": long, "max_tokens": 4}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}, "messages")):
        msg = _err(_post(srv.url, path, body), 400, param, "context_length_exceeded")["message"]
        if param == "messages":
            n = len(ref.encode_prompt(long, chat=True))
        assert f"maximum context length is {limit} tokens" in msg and f"the prompt has {n} tokens" in msg, msg
        assert "the prompt itself does not fit" in msg and "room for" not in msg and "max_tokens" not in msg, msg


@pytest.mark.parametrize("ids", [[-1], [99999999], [6144], [0, -5], "3", 3, [1.5], [True], ["1"]])
def test_stop_token_ids_are_checked(srv, ids):
    e = _err(_post(srv.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop_token_ids": ids}), 400,
             "stop_token_ids")
    if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        assert "[0, 6144)" in e["message"]


def test_stop_token_ids_in_range_are_accepted(srv):
    r = _post(srv.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [0, 6143]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("opts", [{"include_usage": "no"}, {"include_usage": 0}, {"include_usage": [True]},
                                  "yes", [{"include_usage": True}]])
def test_stream_options_are_type_checked(srv, opts):
    r = _post(srv.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True, "stream_options": opts})
    _err(r, 400, "stream_options")


def test_include_usage_false_sends_no_usage_chunk(srv):
    c = srv.client()
    chunks = list(c.completions.create(model=NAME, prompt="hi", max_tokens=2, temperature=0, stream=True,
                                       stream_options={"include_usage": False}))
    assert chunks and all(ch.choices and ch.usage is None for ch in chunks)


@pytest.mark.parametrize("field,value,param", [
    ("temperature", -0.5, "temperature"), ("temperature", 1000, "temperature"), ("top_p", 0, "top_p"),
    ("top_p", 1.5, "top_p"), ("top_k", -2, "top_k"), ("seed", -1, "seed"), ("seed", 2 ** 64, "seed"),
    ("stop", [""], "stop"), ("stop", [f"s{i}" for i in range(17)], "stop"), ("max_tokens", 0, "max_tokens"),
    ("max_completion_tokens", -3, "max_completion_tokens")])
def test_sampling_errors_name_their_param(srv, field, value, param):
    chat = field == "max_completion_tokens"
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi", "max_tokens": 2}
    r = _post(srv.url, "/v1/chat/completions" if chat else "/v1/completions", {**body, field: value})
    _err(r, 400, param)


def test_unknown_path_and_wrong_method_use_the_error_shape(srv):
    e = _err(httpx.get(f"{srv.url}/v1/completions"), 405, None, "method_not_allowed")
    assert "GET /v1/completions" in e["message"]
    assert "POST" in httpx.get(f"{srv.url}/v1/chat/completions").headers.get("allow", "")
    e = _err(httpx.post(f"{srv.url}/v1/no-such-thing", json={}), 404, None, "not_found")
    assert "/v1/no-such-thing" in e["message"]
    assert httpx.get(f"{srv.url}/health").status_code == 200


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_client_leaving_mid_body_logs_one_line(srv):
    seen = _Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "bytebound.server")]
    for lg in loggers:
        lg.addHandler(seen)
    try:
        port = int(srv.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"model\": ")
            time.sleep(0.3)                            # the handler is reading the body when we leave
        assert _wait(lambda: seen.records, 10)
        time.sleep(0.3)                                # anything more (a traceback) would come right after
        got = [(r.levelname, r.getMessage(), bool(r.exc_info)) for r in seen.records]
        assert len(got) == 1 and got[0][0] == "WARNING" and not got[0][2], got
        assert "left while sending the request body" in got[0][1]
    finally:
        for lg in loggers:
            lg.removeHandler(seen)
    assert httpx.get(f"{srv.url}/health").status_code == 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _up(url) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def socket_has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def _serve_banner_url(ckpt, tmp_path, *args) -> str:
    """Start ``bytebound serve --port 0`` with ``args``, wait for its banner, check the server answers at the URL the
    banner names (without ``/v1``), stop it; return that URL as printed."""
    import re
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "bytebound.cli", "serve", "--model", str(ckpt), "--port", "0",
                                 "--log-level", "warning", *args], stdout=f, stderr=subprocess.STDOUT)
    try:
        found = []

        def banner():
            found[:] = re.findall(r"\[bytebound serve\] model .*(http://\S+/v1)", log.read_text())
            return bool(found) or proc.poll() is not None
        assert _wait(banner, 60) and found, log.read_text()
        assert _up(found[0][:-3]), log.read_text()
        return found[0]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_port_0_prints_the_bound_port(ckpt, tmp_path):
    """``bytebound serve --port 0``: the banner names the port the system picked (it printed 0 before it was
    bound), and the server answers there."""
    import re
    url = _serve_banner_url(ckpt, tmp_path)
    m = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/v1", url)
    assert m and int(m.group(1)) != 0, url


@pytest.mark.parametrize("where", ["busy", "bad_host"])
def test_serve_checks_its_address_before_loading_the_model(tmp_path, capsys, where):
    """``bytebound serve`` binds its port before it loads the model: a port another server listens on, or a host
    that does not resolve, is exit 2 naming host:port at once (it loaded the whole checkpoint, printed "Application
    startup complete", then failed with "[Errno 98] address already in use"). The model named here does not
    exist: reaching the load would be a different error."""
    from bytebound.cli import main
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    host, port = ("127.0.0.1", busy.getsockname()[1]) if where == "busy" else ("no-such-host.invalid", 8000)
    try:
        rc = main(["serve", "--model", str(tmp_path / "no-model-here"), "--host", host, "--port", str(port)])
    finally:
        busy.close()
    err = capsys.readouterr().err
    assert rc == 2 and f"cannot listen on {host}:{port}" in err, err
    assert "no-model-here" not in err


def test_bind_socket_listens_so_a_second_server_fails_at_once():
    """Two ``bind_socket`` on one port: the second fails. With SO_REUSEADDR two sockets may bind a port that nobody
    listens on, so a second ``serve`` started while the first still loaded its model passed the check and failed
    only after its own load."""
    from bytebound.server.app import bind_socket
    first = bind_socket("127.0.0.1", 0)
    try:
        with pytest.raises(OSError):
            bind_socket("127.0.0.1", first.getsockname()[1]).close()
    finally:
        first.close()


def test_serve_interrupted_while_loading_exits_quietly(monkeypatch, capsys):
    """Ctrl-C while the model loads: exit 130 with one line, no traceback, and the port released at once."""
    from bytebound.cli import main
    import bytebound.engine.engine as engine_mod

    def interrupted(cfg):
        raise KeyboardInterrupt
    monkeypatch.setattr(engine_mod, "Engine", interrupted)
    port = _free_port()
    assert main(["serve", "--port", str(port)]) == 130
    assert "interrupted while loading the model" in capsys.readouterr().err
    from bytebound.server.app import bind_socket
    bind_socket("127.0.0.1", port).close()          # free again


@pytest.mark.skipif(not socket_has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_serve_banner_brackets_an_ipv6_host(ckpt, tmp_path):
    """``--host ::1``: the banner's URL is ``http://[::1]:PORT/v1`` (it printed ``http://::1:PORT/v1``), and the
    server answers there."""
    import re
    url = _serve_banner_url(ckpt, tmp_path, "--host", "::1")
    assert re.fullmatch(r"http://\[::1\]:\d+/v1", url), url


def test_sigterm_cancels_requests_in_flight(ckpt, tmp_path):
    """``bytebound serve`` on SIGTERM: the running stream ends with a ``cancelled`` event and [DONE], the queued
    request gets 503, the process exits at once (plain uvicorn waited for the whole generation)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "bytebound.cli", "serve", "--model", str(ckpt), "--port",
                                 str(port), "--served-model-name", NAME, "--timeout-graceful-shutdown", "0",
                                 "--log-level", "warning"], stdout=f, stderr=subprocess.STDOUT)
    try:
        assert _wait(lambda: proc.poll() is None and _up(url), 60), log.read_text()
        long = {"prompt": "long one", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
        box = {}
        tb = threading.Thread(target=lambda: box.setdefault("b", _post(url, "/v1/completions", long)))
        with httpx.stream("POST", f"{url}/v1/completions", json={"model": NAME, **long, "stream": True},
                          timeout=60) as ra:
            lines = ra.iter_lines()
            assert next(ln for ln in lines if ln.startswith("data: "))
            tb.start()
            assert _wait(lambda: httpx.get(f"{url}/server_info").json()["queued"] == 1)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rest = [ln for ln in lines if ln.startswith("data: ")]
        assert proc.wait(timeout=30) is not None and time.monotonic() - t0 < 15, log.read_text()
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["code"] == "cancelled"
        assert len(rest) < 4000
        tb.join(timeout=30)
        _err(box["b"], 503, code="cancelled")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- issue 22 (6): one large request must not stall the event loop ------------------------------------------
NANO = "ling-nano"


@pytest.fixture(scope="module")
def nano_engine():
    """The bundled trained ling-nano, plain decoding, on CPU."""
    from conftest import NANO_TOKENIZER
    return Engine(model=str(NANO_TOKENIZER))


def _stalls_while(url, big_request, health_every=0.05):
    """Run ``big_request()`` (on another thread) while a stream runs and ``/health`` is polled on this one.
    Returns ``(big_request's result, largest gap between stream events, slowest /health answer, health checks,
    seconds the big request took)``; the gap is over the window from the big request's start to 0.3 s after its
    end (its ends count as events: a stream that stops altogether has a gap of the whole window). Every loop is
    bounded (the stream by max_tokens, the polls by time)."""
    events, stop, box = [], threading.Event(), {}

    def streamer():
        body = {"model": NANO, "prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.Client(timeout=60) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(time.perf_counter())
                    if stop.is_set():
                        break
        except Exception as e:             # reported by the caller's assertion on box
            box["stream_error"] = repr(e)

    ts = threading.Thread(target=streamer, daemon=True)
    ts.start()
    assert _wait(lambda: len(events) >= 3 or "stream_error" in box, 60), box
    tb = threading.Thread(target=lambda: box.setdefault("big", big_request()), daemon=True)
    t0 = time.perf_counter()
    tb.start()
    health = []
    with httpx.Client(timeout=30) as hc:         # one client: the times are the server's, not the client's set-up
        while tb.is_alive() and time.perf_counter() - t0 < 60:
            h0 = time.perf_counter()
            assert hc.get(f"{url}/health").status_code == 200
            health.append(time.perf_counter() - h0)
            time.sleep(health_every)
    tb.join(timeout=60)
    t1 = time.perf_counter()
    time.sleep(0.3)
    stop.set()
    ts.join(timeout=30)
    assert "stream_error" not in box and not ts.is_alive(), box
    window = [t0] + [t for t in events if t0 < t < t1 + 0.3] + [t1 + 0.3]
    gap = max(b - a for a, b in zip(window, window[1:]))
    return box.get("big"), gap, max(health, default=float("inf")), len(health), t1 - t0


@pytest.fixture(scope="module")
def nano_proc(tmp_path_factory):
    """``bytebound serve`` over the bundled ling-nano in its own process (so the test's clients do not share its
    GIL, as real clients do not), with ``--max-prompt-chars 3000000``: the body limit that follows is 16 MiB,
    the limit of the issue's server, so a 10 MB body is read and parsed."""
    from conftest import NANO_TOKENIZER
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("nano-serve") / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "bytebound.cli", "serve", "--model", str(NANO_TOKENIZER),
                                 "--port", str(port), "--served-model-name", NANO, "--max-prompt-chars", "3000000",
                                 "--log-level", "warning"], stdout=f, stderr=subprocess.STDOUT)
    try:
        assert _wait(lambda: proc.poll() is None and _up(url), 120), log.read_text()
        info = httpx.get(f"{url}/server_info").json()
        assert info["max_prompt_chars"] == 3_000_000 and info["max_body_bytes"] == 16 << 20
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_10mb_prompt_is_refused_fast_without_stalling_others(nano_proc):
    """Issue 22 (6): a 10 MB prompt was tokenised on the event loop (its 400 came after 21 s; /health and a
    running stream stalled as long). Now its length in characters refuses it before tokenisation, the body is
    parsed off the loop, and neither the running stream nor /health notices."""
    for path, body in (("/v1/completions", {"prompt": "hello world " * 850_000, "max_tokens": 4}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello world " * 850_000}]})):
        raw = json.dumps({"model": NANO, **body}).encode()
        assert len(raw) > 10_000_000
        r, gap, slowest, checks, took = _stalls_while(nano_proc, lambda: _post(nano_proc, path, raw))
        e = _err(r, 400, "messages" if "chat" in path else "prompt", "prompt_too_long")
        assert "10200000 characters" in e["message"], e
        assert gap < 0.5, f"{path}: the stream stalled {gap:.2f} s"
        assert checks >= 1 and slowest < 0.5, f"{path}: /health took {slowest:.2f} s"


def test_tokenising_a_large_prompt_does_not_stall_others(nano_proc, nano_engine):
    """A 1.2-million-character prompt under the raised limit is tokenised (seconds of tokenizer work) and then
    refused as ``context_length_exceeded``. The tokenisation runs off the event loop without holding the GIL:
    on the loop, or in a thread with ``tokenizers``' GIL-holding ``encode``, it stalls the stream and /health."""
    prompt = "hello world " * 100_000
    r, gap, slowest, checks, took = _stalls_while(
        nano_proc, lambda: _post(nano_proc, "/v1/completions", {"model": NANO, "prompt": prompt, "max_tokens": 4}))
    e = _err(r, 400, "prompt", "context_length_exceeded")
    assert f"the prompt has {len(nano_engine.tokenizer.encode(prompt))} tokens" in e["message"]
    assert took > 0.5, f"the tokenisation took only {took:.2f} s: the test proves nothing"
    assert gap < 0.5, f"the stream stalled {gap:.2f} s"
    assert checks >= 1 and slowest < 0.5, f"/health took {slowest:.2f} s"


def test_prompt_chars_limit_is_exact_and_named(srv):
    """Prompts over max_prompt_chars (default max_model_len x 32) are refused before tokenisation; one at the
    limit is tokenised (and then too long in tokens here)."""
    info = httpx.get(f"{srv.url}/server_info").json()
    limit = info["max_prompt_chars"]
    assert limit == info["max_model_len"] * 32
    assert info["max_body_bytes"] == min(16 << 20, 12 * limit + (1 << 20))
    e = _err(_post(srv.url, "/v1/completions", {"prompt": "ab" * (limit // 2) + "c"}), 400, "prompt",
             "prompt_too_long")
    assert f"{limit + 1} characters" in e["message"] and f"limit of {limit}" in e["message"]
    _err(_post(srv.url, "/v1/completions", {"prompt": "ab" * (limit // 2)}), 400, "prompt", "context_length_exceeded")
    # chat: the message contents together
    msgs = [{"role": "user", "content": "a" * (limit // 2)}, {"role": "assistant", "content": "b" * (limit // 2)},
            {"role": "user", "content": "c"}]
    _err(_post(srv.url, "/v1/chat/completions", {"messages": msgs}), 400, "messages", "prompt_too_long")
    # a body over the limit without Content-Length (chunked upload) is cut off too
    def chunks():
        yield b'{"model": "%s", "prompt": "' % NAME.encode()
        for _ in range(info["max_body_bytes"] // 65536 + 1):
            yield b"x" * 65536
        yield b'"}'
    r = httpx.post(f"{srv.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=60)
    _err(r, 413, None, "body_too_large")
    assert httpx.get(f"{srv.url}/health").status_code == 200


def test_encode_releasing_gil_matches_encode(nano_engine):
    tok = nano_engine.tokenizer
    for text in ("Hello, world!", "<role>HUMAN</role>2+2=?", "\u4e2d\u6587 \U0001f600 " * 7, " \n\t  x"):
        assert tok.encode_releasing_gil(text) == tok.encode(text)


# ---- issue 22 (7): metrics a dashboard would miss ------------------------------------------------------------
def _errors(url) -> dict:
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("bytebound_request_errors_total{"):
            labels = dict(kv.split("=") for kv in line[line.index("{") + 1:line.index("}")].split(","))
            out[(labels["status"].strip('"'), labels["reason"].strip('"'))] = float(line.split()[-1])
    return out


def test_every_error_response_is_counted_with_status_and_reason(srv):
    before = _errors(srv.url)
    _post(srv.url, "/v1/completions", {"prompt": "hi", "max_tokens": -1})                  # 400 max_tokens
    _post(srv.url, "/v1/completions", {"prompt": "hi", "max_tokens": -1})
    _post(srv.url, "/v1/completions", b'{"model": ')                                        # 400 invalid_json
    _post(srv.url, "/v1/completions", {"model": "nope", "prompt": "hi"})                    # 404 model
    _post(srv.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 5000}]})
    httpx.get(f"{srv.url}/v1/completions")                                                  # 405
    httpx.get(f"{srv.url}/v1/nothing")                                                      # 404 path
    big = b'{"prompt": "' + b"x" * httpx.get(f"{srv.url}/server_info").json()["max_body_bytes"] + b'"}'
    _post(srv.url, "/v1/completions", big)                                                  # 413
    r = srv.client().completions.create(model=NAME, prompt="fine", max_tokens=2, temperature=0)
    assert r.choices                                                                        # no error
    after = _errors(srv.url)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert delta == {("400", "max_tokens"): 2, ("400", "invalid_json"): 1, ("404", "model_not_found"): 1,
                     ("400", "context_length_exceeded"): 1, ("405", "method_not_allowed"): 1,
                     ("404", "not_found"): 1, ("413", "body_too_large"): 1}, delta


def test_accept_length_histogram_skips_requests_without_a_verify_round():
    """max_tokens=1 comes from the prefill alone: no verify round, no accept length (it used to add a 0)."""
    from conftest import NANO_TOKENIZER
    eng = Engine(model=str(NANO_TOKENIZER), speculative_steps=2, max_model_len=256)
    s = Server(create_app(eng, served_model_name=NANO, max_queue=2))
    try:
        c = s.client()
        assert c.completions.create(model=NANO, prompt="One", max_tokens=1, temperature=0).usage \
            .completion_tokens == 1
        hist = "bytebound_spec_accept_length_per_request"
        assert _metric(s.url, f"{hist}_count") == 0 and _metric(s.url, f"{hist}_sum") == 0
        r = c.completions.create(model=NANO, prompt="Once upon a time", max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 12
        assert _metric(s.url, f"{hist}_count") == 1
        # the one observation is that request's accept length: the engine's running total holds only its rounds
        got, want = _metric(s.url, f"{hist}_sum"), eng.spec_totals.accept_length
        assert want >= 1 and got == pytest.approx(want, abs=1e-4)
        assert _metric(s.url, "bytebound_spec_accept_length") == pytest.approx(want)
    finally:
        s.stop()


def test_cancelled_requests_are_logged_and_counted_as_cancelled(srv):
    """A stream the client leaves is logged as cancelled (uvicorn's access line, written when the response
    started, says 200) and counted; a non-streaming request whose client gives up too."""
    seen = _Records()
    lg = logging.getLogger("bytebound.server")
    level = lg.level
    lg.addHandler(seen)
    lg.setLevel(logging.INFO)
    metric = "bytebound_requests_cancelled_total"
    n0 = _metric(srv.url, metric, '{reason="client_disconnected"}')
    ttft0 = _metric(srv.url, "bytebound_time_to_first_token_seconds_count")
    long = {"model": NAME, "prompt": "long one", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    try:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={**long, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                assert next(ln for ln in lines if ln.startswith("data: "))
        assert _wait(lambda: _metric(srv.url, metric, '{reason="client_disconnected"}') == n0 + 1)
        # its tokens had started: its time to first token is in the histogram, as a completed request's is
        assert _wait(lambda: _metric(srv.url, "bytebound_time_to_first_token_seconds_count") == ttft0 + 1)
        msgs = [rec.getMessage() for rec in seen.records]
        assert len(msgs) == 1 and "cancelled (client disconnected) after" in msgs[0], msgs
        assert '"POST /v1/completions" cmpl-' in msgs[0] and seen.records[0].levelname == "INFO"
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{srv.url}/v1/completions", json=long, timeout=1.0)
        assert _wait(lambda: _metric(srv.url, metric, '{reason="client_disconnected"}') == n0 + 2)
        assert _wait(lambda: len(seen.records) == 2)
        assert "cancelled (client disconnected), " in seen.records[1].getMessage()
        # a completed stream logs nothing
        list(srv.client().completions.create(model=NAME, prompt="hi", max_tokens=2, temperature=0, stream=True))
        time.sleep(0.2)
        assert len(seen.records) == 2
    finally:
        lg.removeHandler(seen)
        lg.setLevel(level)

