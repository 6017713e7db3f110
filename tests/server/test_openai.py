"""The OpenAI door with the official ``openai`` client against a real server with API keys.

One in-process server on the tiny random-init models. Its answers are checked against
pytrio's ``sample()`` on the same prompt tokens (the same batched sampler), its logprobs
against the trainer's ``compute_logprobs`` (a forward pass, not the sampler), and a LoRA
trained to answer "日本語です" then EOS gives a checkpoint whose replies are known: a
multi-byte text that ends at the end of turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

import pytrio as trio
from trio_server import openai_wire as w
from trio_server.app import create_app
from trio_server.core import ServiceCore

from ..polling import wait_until
from ..sdk.conftest import ServerThread, core_server

openai = pytest.importorskip("openai")

TINY = "trio/tiny-llama"
QWEN = "trio/tiny-qwen3"
HELLO = [{"role": "user", "content": "hello"}]
ANSWER = "日本語です"  # 9 SmolLM2 tokens: 日 and で take two each, 語 three


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with core_server(tmp_path_factory.mktemp("openai")) as server:
        yield server


@dataclass
class User:
    key: str
    client: Any  # openai.OpenAI
    service: trio.ServiceClient


def new_user(server, name: str) -> User:
    key = server.core.store.create_api_key(name)
    client = openai.OpenAI(base_url=server.url + "/openai/v1", api_key=key, max_retries=0)
    return User(key, client, trio.ServiceClient(base_url=server.url, api_key=key))


@pytest.fixture(scope="module")
def alice(server) -> User:
    return new_user(server, "alice")


@pytest.fixture(scope="module")
def bob(server) -> User:
    return new_user(server, "bob")


@pytest.fixture(scope="module")
def base(alice) -> trio.SamplingClient:
    return alice.service.create_sampling_client(base_model=TINY)


@pytest.fixture(scope="module")
def tok(base):
    return base.get_tokenizer()


def chat_tokens(tok, messages=HELLO) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


@dataclass
class Trained:
    path: str
    sampler: trio.SamplingClient


@pytest.fixture(scope="module")
def trained(alice, tok) -> Trained:
    """A LoRA that answers "hello" with ANSWER then EOS (greedy), and its sampler checkpoint."""
    tc = alice.service.create_lora_training_client(base_model=TINY, rank=16)
    prompt = chat_tokens(tok)
    reply = tok.encode(ANSWER, add_special_tokens=False) + [tok.eos_token_id]
    tokens = prompt + reply
    datum = trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:],
                                       "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(reply)})
    for _ in range(60):
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(trio.AdamParams(learning_rate=3e-3))
    path = tc.save_weights_for_sampler("answers").result().path
    sampler = alice.service.create_sampling_client(model_path=path)
    greedy = sampler.sample(trio.ModelInput.from_ints(prompt), 1, trio.SamplingParams(max_tokens=16, temperature=0))
    assert greedy.result().sequences[0].tokens == reply  # the premise of the tests that use it
    return Trained(path, sampler)


def tiny_worker(server, user: User):
    """The tiny Llama's worker, made by a first request if no test has made it yet."""
    user.client.completions.create(model=TINY, prompt="a", max_tokens=1)
    return server.core.workers[TINY]


def pytrio_sample(sampler, tokens: list[int], **params) -> trio.SampledSequence:
    response = sampler.sample(trio.ModelInput.from_ints(tokens), 1, trio.SamplingParams(**params)).result()
    return response.sequences[0]


# -- answers: the same sampler as pytrio's -----------------------------------------------------


def test_chat_greedy_equals_pytrio_sample_on_the_same_tokens(alice, base, tok):
    reply = alice.client.chat.completions.create(model=TINY, messages=HELLO, max_tokens=12, temperature=0)
    prompt = chat_tokens(tok)
    seq = pytrio_sample(base, prompt, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == seq.text and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "length" == seq.stop_reason
    assert reply.object == "chat.completion" and reply.model == TINY and reply.id.startswith("chatcmpl-")
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
        len(prompt), 12, len(prompt) + 12)


def test_chat_on_the_tiny_qwen3_uses_its_own_template(alice):
    sampler = alice.service.create_sampling_client(base_model=QWEN)
    qtok = sampler.get_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, *HELLO]
    reply = alice.client.chat.completions.create(model=QWEN, messages=messages, max_tokens=6, temperature=0)
    prompt = chat_tokens(qtok, messages)
    assert qtok.decode(prompt).endswith("<|im_start|>assistant\n")
    assert reply.choices[0].message.content == pytrio_sample(sampler, prompt, max_tokens=6, temperature=0).text
    assert reply.usage.prompt_tokens == len(prompt)


def test_completion_greedy_equals_pytrio_sample_on_string_and_token_prompts(alice, base, tok):
    prompt = "The capital of France is"
    tokens = tok.encode(prompt)
    seq = pytrio_sample(base, tokens, max_tokens=10, temperature=0)
    by_text = alice.client.completions.create(model=TINY, prompt=prompt, max_tokens=10, temperature=0)
    by_ids = alice.client.completions.create(model=TINY, prompt=tokens, max_tokens=10, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text == seq.text
    assert by_text.object == "text_completion" and by_text.usage.prompt_tokens == len(tokens)


def test_several_prompts_give_n_choices_each_in_order(alice, base, tok):
    prompts = ["one two", "three"]
    reply = alice.client.completions.create(model=TINY, prompt=prompts, n=2, max_tokens=4, temperature=0)
    expected = [pytrio_sample(base, tok.encode(p), max_tokens=4, temperature=0).text for p in prompts]
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [expected[0], expected[0], expected[1], expected[1]]
    assert reply.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert reply.usage.completion_tokens == 16


def test_trained_checkpoint_answers_as_its_sampler_and_unlike_the_base(alice, trained):
    def answer(model: str) -> str:
        reply = alice.client.chat.completions.create(model=model, messages=HELLO, max_tokens=16, temperature=0)
        return reply.choices[0].message.content

    assert answer(trained.path) == ANSWER
    assert answer(trained.path.replace("trio://", "tinker://")) == ANSWER  # the tinker door's paths too
    assert answer(TINY) != ANSWER


def test_chat_ends_at_the_end_of_turn(alice, tok, trained):
    reply = alice.client.chat.completions.create(model=trained.path, messages=HELLO, max_tokens=16, temperature=0,
                                                 logprobs=True)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == ANSWER  # no <|im_end|> in the text
    assert reply.usage.completion_tokens == len(tok.encode(ANSWER, add_special_tokens=False)) + 1  # EOS counted
    assert b"".join(bytes(e.bytes) for e in choice.logprobs.content) == ANSWER.encode()  # EOS not in logprobs


def test_a_stop_sequence_ends_the_text_before_it(alice, trained):
    reply = alice.client.chat.completions.create(model=trained.path, messages=HELLO, max_tokens=16, temperature=0,
                                                 stop=["語", "zzz"], logprobs=True)
    choice = reply.choices[0]
    assert (choice.message.content, choice.finish_reason) == ("日本", "stop")
    assert b"".join(bytes(e.bytes) for e in choice.logprobs.content) == "日本".encode()
    assert reply.usage.completion_tokens == 6  # 日 本 and the three tokens of 語 that matched the stop


def test_default_max_tokens(alice, tok):
    """Chat: DEFAULT_CHAT_MAX_TOKENS within the model's context (512 for the tiny Llama);
    completions: OpenAI's 16."""
    chat = alice.client.chat.completions.create(model=TINY, messages=HELLO, temperature=0)
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 512 - len(chat_tokens(tok))
    completion = alice.client.completions.create(model=TINY, prompt="a b c", temperature=0)
    assert completion.usage.completion_tokens == 16 and completion.choices[0].finish_reason == "length"


# -- streaming --------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_deltas_add_up_to_the_non_streamed_reply(alice, endpoint):
    def create(**kwargs):
        params = dict(model=TINY, max_tokens=12, temperature=1.0, seed=11, n=2, **kwargs)
        if endpoint == "chat":
            return alice.client.chat.completions.create(messages=HELLO, **params)
        return alice.client.completions.create(prompt="Once upon a time", **params)

    whole = create()
    texts, finishes, usage = ["", ""], [None, None], []
    for chunk in create(stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage.append(chunk.usage)
            assert chunk.choices == []
        for c in chunk.choices:
            texts[c.index] += (c.delta.content or "") if endpoint == "chat" else c.text
            finishes[c.index] = c.finish_reason or finishes[c.index]
    if endpoint == "chat":
        assert texts == [c.message.content for c in whole.choices]
    else:
        assert texts == [c.text for c in whole.choices]
    assert texts[0] != texts[1]  # two samples, not one twice
    assert finishes == [c.finish_reason for c in whole.choices]
    assert usage == [whole.usage]


def test_the_stream_is_server_sent_events(server, alice):
    body = {"model": TINY, "messages": HELLO, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/openai/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {alice.key}"}, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = response.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-2])
    assert [c["choices"][0]["delta"] for c in chunks][0] == {"role": "assistant", "content": ""}
    assert len(chunks) == 1 + 3 + 1 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len({c["id"] for c in chunks}) == 1 and "usage" not in chunks[0]


def test_a_character_split_across_tokens_streams_whole(alice, trained):
    stream = alice.client.chat.completions.create(model=trained.path, messages=HELLO, max_tokens=16, temperature=0,
                                                  logprobs=True, stream=True)
    pieces = [(c.choices[0].delta.content, c.choices[0].logprobs) for c in stream if c.choices[0].delta.content]
    assert [text for text, _ in pieces] == list(ANSWER)  # one chunk per character
    assert [len(lp.content) for _, lp in pieces] == [2, 1, 3, 2, 1]  # of one or more tokens
    assert pieces[0][1].content[0].token == "bytes:\\xe6\\x97"  # part of 日: not text on its own
    for text, lp in pieces:
        assert b"".join(bytes(e.bytes) for e in lp.content) == text.encode()


# -- sampling parameters ----------------------------------------------------------------------


def test_n_samples_are_one_sample_request_sharing_the_prompt(server, alice):
    engine = tiny_worker(server, alice).engine
    jobs: list = []
    real = engine.decode  # sampling runs in the worker's continuous decode batch
    engine.decode = lambda admit, max_steps=1: jobs.extend(admit.values()) or real(admit, max_steps)
    try:
        reply = alice.client.chat.completions.create(model=TINY, messages=HELLO, max_tokens=5, n=3, seed=4)
    finally:
        engine.decode = real
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [job.request.num_samples for job in jobs] == [3]
    assert reply.usage.completion_tokens == 15


def test_a_seed_reproduces_a_sample(alice):
    def text(seed: int) -> str:
        reply = alice.client.completions.create(model=TINY, prompt="a", max_tokens=16, temperature=1.0, seed=seed)
        return reply.choices[0].text

    assert text(7) == text(7)
    assert text(7) != text(8)


def test_vllm_extras_top_k_and_ignore_eos_are_taken(alice):
    """vLLM's extras, as the openai client sends them (extra_body): top_k 1 samples the
    likeliest token at any temperature; top_k 0 and -1 are off; ignore_eos reaches the
    sampler, and a chat then drops the template's end-of-turn stop as well."""
    greedy = alice.client.completions.create(model=TINY, prompt="a", max_tokens=8, temperature=0)
    for seed in (1, 2):
        top1 = alice.client.completions.create(model=TINY, prompt="a", max_tokens=8, temperature=1.5, seed=seed,
                                               extra_body={"top_k": 1})
        assert top1.choices[0].text == greedy.choices[0].text
    off = [alice.client.completions.create(model=TINY, prompt="a", max_tokens=8, temperature=1.5, seed=4,
                                           extra_body={"top_k": k}).choices[0].text for k in (0, -1, None)]
    assert off[0] == off[1] == off[2] != greedy.choices[0].text

    body = w.parse(w.ChatBody, {"model": TINY, "messages": HELLO, "top_k": 5, "ignore_eos": True})
    params = w.sampling_params(body, 4, ["x"])
    assert (params["top_k"], params["ignore_eos"], params["stop"]) == (5, True, ["x"])
    plain = w.sampling_params(w.parse(w.ChatBody, {"model": TINY, "messages": HELLO}), 4, [])
    assert (plain["top_k"], plain["ignore_eos"], plain["stop"]) == (-1, False, None)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_logprobs_are_the_trainers(alice, base, tok, endpoint):
    """Each returned logprob equals compute_logprobs (a plain forward pass) of the same tokens."""
    params = dict(model=TINY, max_tokens=8, temperature=1.0, seed=5)
    if endpoint == "chat":
        prompt = chat_tokens(tok)
        choice = alice.client.chat.completions.create(messages=HELLO, logprobs=True, top_logprobs=0, **params).choices[0]
        got = [e.logprob for e in choice.logprobs.content]
        assert all(e.top_logprobs == [] for e in choice.logprobs.content)
        text, raw = choice.message.content, [bytes(e.bytes) for e in choice.logprobs.content]
    else:
        prompt = tok.encode("The sky is")
        choice = alice.client.completions.create(prompt="The sky is", logprobs=0, **params).choices[0]
        got, text, raw = choice.logprobs.token_logprobs, choice.text, None
        assert choice.logprobs.top_logprobs is None
    seq = pytrio_sample(base, prompt, max_tokens=8, temperature=1.0, seed=5)  # the same draw: its token ids
    assert seq.text == text and len(seq.tokens) == len(got) == 8
    if raw is not None:
        assert raw == [w.token_bytes(w.Codec.of(tok), t) for t in seq.tokens]
    reference = base.compute_logprobs(trio.ModelInput.from_ints(prompt + seq.tokens)).result()[len(prompt):]
    assert got == pytest.approx(reference, abs=1e-4)


# -- models -----------------------------------------------------------------------------------


def test_models_lists_base_models_and_own_sampler_checkpoints(server, alice, bob, trained):
    alice.service.create_lora_training_client(base_model=TINY, rank=2).save_state("not-a-model").result()
    ids = [m.id for m in alice.client.models.list().data]
    base_models = server.core.capabilities().supported_models
    assert ids[:len(base_models)] == base_models and trained.path in ids
    assert all(i in base_models or i.startswith("trio://run-") and "/sampler_weights/" in i for i in ids)
    listed = {m.id: m for m in alice.client.models.list().data}[trained.path]
    assert listed.object == "model" and listed.created > 0
    assert trained.path not in [m.id for m in bob.client.models.list().data]
    assert alice.client.models.retrieve(TINY).id == TINY


@pytest.mark.parametrize("model", ["no/such-model", "trio://run-0123456789ab/sampler_weights/nope",
                                   "trio://not-a-path", "tinker://run-0123456789ab/sampler_weights/nope"])
def test_an_unknown_model_is_404_model_not_found(alice, model):
    with pytest.raises(openai.NotFoundError) as caught:
        alice.client.chat.completions.create(model=model, messages=HELLO, max_tokens=2)
    assert (caught.value.type, caught.value.code, caught.value.param) == ("invalid_request_error", "model_not_found",
                                                                          "model")
    assert repr(model) in caught.value.message  # as the client wrote it


def test_a_training_checkpoint_is_not_a_model(alice):
    tc = alice.service.create_lora_training_client(base_model=TINY, rank=2)
    path = tc.save_state("state").result().path
    with pytest.raises(openai.NotFoundError, match="sampler_weights"):
        alice.client.completions.create(model=path, prompt="a", max_tokens=2)


def test_another_users_checkpoint_is_a_404_like_an_unknown_one(alice, bob, trained):
    unknown = trained.path.rsplit("/", 1)[0] + "/no-such-name"

    def error(user: User, model: str) -> dict:
        with pytest.raises(openai.NotFoundError) as caught:
            user.client.chat.completions.create(model=model, messages=HELLO, max_tokens=2)
        return json.loads(caught.value.response.text.replace(model, "<model>"))

    assert alice.client.chat.completions.create(model=trained.path, messages=HELLO, max_tokens=2).choices
    assert error(bob, trained.path) == error(bob, unknown)
    assert error(bob, trained.path)["error"]["code"] == "model_not_found"


def test_a_deleted_checkpoint_is_404_and_its_sampler_forgotten(server, alice, tok, monkeypatch):
    tc = alice.service.create_lora_training_client(base_model=TINY, rank=2)
    path = tc.save_weights_for_sampler("short-lived").result().path
    assert alice.client.completions.create(model=path, prompt="a", max_tokens=2).choices
    alice.service.create_rest_client().delete_checkpoint(path)
    with pytest.raises(openai.NotFoundError) as caught:
        alice.client.completions.create(model=path, prompt="a", max_tokens=2)
    assert caught.value.code == "model_not_found"
    tc.save_weights_for_sampler("short-lived").result()  # the same path again
    ops: list[str] = []
    submit = server.core.submit
    monkeypatch.setattr(server.core, "submit", lambda user, op, *a, **k: ops.append(op) or submit(user, op, *a, **k))
    assert alice.client.completions.create(model=path, prompt="a", max_tokens=2).choices
    assert ops == ["create_sampler", "sample"]  # the failed sampler was dropped, not reused


# -- keys and errors --------------------------------------------------------------------------


def test_a_missing_or_invalid_key_is_401(server):
    for headers in ({}, {"Authorization": "Bearer trio-nope"}):
        for method, path in [("GET", "/models"), ("POST", "/chat/completions"), ("POST", "/completions")]:
            r = httpx.request(method, server.url + "/openai/v1" + path, headers=headers, json={"model": TINY})
            assert r.status_code == 401, (headers, path)
            assert r.json()["error"]["type"] == "invalid_request_error"
    bad = openai.OpenAI(base_url=server.url + "/openai/v1", api_key="trio-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_no_auth_needs_no_key(tmp_path):
    core = ServiceCore(tmp_path, dtype="float32")
    srv = ServerThread(create_app(core, auth=False))
    try:
        r = httpx.post(srv.url + "/openai/v1/completions", json={"model": TINY, "prompt": "a", "max_tokens": 2},
                       timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        client = openai.OpenAI(base_url=srv.url + "/openai/v1", api_key="anything", max_retries=0)
        assert TINY in [m.id for m in client.models.list().data]
    finally:
        srv.stop()
        core.close()


CHAT_REFUSED = [
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ({"min_tokens": 4}, "min_tokens"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"structured_outputs": {"json": {"type": "object"}}}, "structured_outputs"),
    ({"min_p": 0.1}, "min_p"),
    ({"stop_token_ids": [2]}, "stop_token_ids"),
    ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"top_k": -2}, "top_k"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"logit_bias": {"17": 5}}, "logit_bias"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logprobs": True, "top_logprobs": 2}, "top_logprobs"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": -0.1}, "top_p"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"n": 0}, "n"),
    ({"n": 1000}, "n"),
    ({"stop": ""}, "stop"),
    ({"seed": "x"}, "seed"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"content": "no role"}]}, "messages[0].role"),
]
COMPLETION_REFUSED = [
    ({"echo": True}, "echo"),
    ({"suffix": "end"}, "suffix"),
    ({"logprobs": 2}, "logprobs"),
    ({"best_of": 3}, "best_of"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [[1, 2], [10**9]]}, "prompt[1]"),
    ({"prompt": None}, "prompt"),
]


@pytest.mark.parametrize(("endpoint", "change", "param"),
                         [("chat", *c) for c in CHAT_REFUSED] + [("completions", *c) for c in COMPLETION_REFUSED])
def test_a_bad_or_unimplemented_param_is_400_naming_it(alice, endpoint, change, param):
    body = ({"model": TINY, "messages": HELLO, "max_tokens": 2} if endpoint == "chat"
            else {"model": TINY, "prompt": "a", "max_tokens": 2}) | change
    create = alice.client.chat.completions.create if endpoint == "chat" else alice.client.completions.create
    with pytest.raises(openai.BadRequestError) as caught:
        create(**{k: v for k, v in body.items() if k in ("model", "messages", "prompt")},
               extra_body={k: v for k, v in body.items() if k not in ("model", "messages", "prompt")})
    assert (caught.value.type, caught.value.param) == ("invalid_request_error", param)
    assert param.split("[")[0] in caught.value.message


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
    ({"messages": HELLO, "stop": ["ok", "\udfff"]}, "stop[1]"),
])
def test_a_lone_surrogate_is_400_naming_where_not_a_server_error(server, alice, body, param):
    """JSON's "\\ud800" parses to a string no tokenizer takes (the openai client cannot
    even send one; raw HTTP can)."""
    r = httpx.post(server.url + "/openai/v1/chat/completions", content=json.dumps({"model": TINY, "max_tokens": 2} | body),
                   headers={"Authorization": f"Bearer {alice.key}", "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_json_nested_deeper_than_the_parser_goes_is_a_400(server, alice):
    """It was a 500 ("maximum recursion depth exceeded"); the other doors answered 400."""
    r = httpx.post(server.url + "/openai/v1/completions", content=b'{"model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                   headers={"Authorization": f"Bearer {alice.key}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"], r.text


def test_top_p_zero_is_greedy(alice):
    """OpenAI allows top_p = 0: the likeliest token alone, whatever the temperature and seed."""
    greedy = alice.client.chat.completions.create(model=TINY, messages=HELLO, max_tokens=8, temperature=0)
    for seed in (1, 2):
        top_p_0 = alice.client.chat.completions.create(model=TINY, messages=HELLO, max_tokens=8, temperature=1.5,
                                                       top_p=0, seed=seed)
        assert top_p_0.choices[0].message.content == greedy.choices[0].message.content


@pytest.mark.parametrize("call", ["embeddings", "delete model"])
def test_an_unimplemented_route_is_404_in_openais_shape(alice, call):
    with pytest.raises(openai.NotFoundError) as caught:
        if call == "embeddings":
            alice.client.embeddings.create(model=TINY, input="hello")
        else:
            alice.client.models.delete(TINY)
    assert (caught.value.type, caught.value.code) == ("invalid_request_error", "unknown_url")
    assert "not implemented by TRIO" in caught.value.message


def test_neutral_values_and_unknown_fields_are_accepted(alice):
    neutral = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "tools": [], "tool_choice": "none",
               "functions": [], "function_call": "none", "modalities": ["text"], "audio": None, "prediction": None,
               "response_format": {"type": "text"}, "top_logprobs": 0, "user": "u-1", "some_future_field": {"x": 1},
               "repetition_penalty": 1, "min_tokens": 0, "min_p": 0, "stop_token_ids": [], "guided_json": None,
               "skip_special_tokens": True, "use_beam_search": False}
    reply = alice.client.chat.completions.create(model=TINY, messages=HELLO, max_tokens=2, extra_body=neutral)
    assert reply.usage.completion_tokens == 2
    reply = alice.client.completions.create(model=TINY, prompt="a", max_tokens=2, echo=False, suffix=None, best_of=1,
                                            logprobs=0, extra_body={"unknown": True})
    assert reply.usage.completion_tokens == 2


def test_a_server_failure_is_500_server_error(server, alice, monkeypatch):
    def broken(admit, max_steps=1):
        raise RuntimeError("the engine broke")

    monkeypatch.setattr(tiny_worker(server, alice).engine, "decode", broken)
    with pytest.raises(openai.InternalServerError) as caught:
        alice.client.completions.create(model=TINY, prompt="a", max_tokens=2)
    assert caught.value.type == "server_error" and "the engine broke" in caught.value.message


def test_a_prompt_beyond_the_context_is_400(alice):
    with pytest.raises(openai.BadRequestError) as caught:
        alice.client.completions.create(model=TINY, prompt=[5] * 600, max_tokens=2)
    assert (caught.value.param, caught.value.code) == ("prompt", "context_length_exceeded")


# -- one batched sampler for every door -------------------------------------------------------


def test_openai_and_pytrio_samples_share_one_engine_pass(server, alice, bob, base, tok):
    """A chat request and another user's pytrio sample() queued together run in one
    admission to the engine's decode batch: the door adds no inference path of its own."""
    from concurrent.futures import ThreadPoolExecutor

    worker = tiny_worker(server, alice)  # alice's sampler on it exists now: the chat only samples
    other = bob.service.create_sampling_client(base_model=TINY)
    prompt = trio.ModelInput.from_ints(chat_tokens(tok))
    engine, calls = worker.engine, []
    real = engine.decode
    engine.decode = lambda admit, max_steps=1: (admit and calls.append(len(admit))) or real(admit, max_steps)
    try:
        with ThreadPoolExecutor(1) as pool, engine.host.lock:  # keep the worker busy so both queue up
            blocker = other.compute_logprobs(prompt)
            wait_until(lambda: bool(worker.running), "the blocker to run")
            pytrio_future = other.sample(prompt, 1, trio.SamplingParams(max_tokens=4, temperature=0))
            chat = pool.submit(alice.client.chat.completions.create, model=TINY, messages=HELLO, max_tokens=4,
                               temperature=0)
            wait_until(lambda: len(worker.snapshot()) == 2, "both samples to queue")
        blocker.result()
        assert chat.result().choices[0].message.content == pytrio_future.result().sequences[0].text
    finally:
        engine.decode = real
    assert calls == [2], calls


# -- pure translation -------------------------------------------------------------------------


def test_detokenize_gives_whole_characters_once_complete(tok):
    ids = tok.encode(" héllo 日本 ok", add_special_tokens=False)
    pieces = w.detokenize(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == " héllo 日本 ok"
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some token held only part of a character


def test_the_tiny_templates_end_a_turn_with_eos(tok, alice):
    qwen = alice.service.create_sampling_client(base_model=QWEN).get_tokenizer()
    for t in (tok, qwen):
        assert w.end_of_turn(t) == t.eos_token_id == t.convert_tokens_to_ids("<|im_end|>")
        assert w.Codec.of(t).chat_stops(["x"]) == ["x"]


def test_a_turn_not_ending_with_eos_stops_at_its_own_token(server, tmp_path):
    files = server.core.tokenizer_files(QWEN)
    other = files.load(tmp_path)
    other.eos_token = "<|endoftext|>"  # as in Qwen's base models: EOS is not the end of a turn
    codec = w.Codec.of(other)
    assert codec.chat_stops(["x"]) == ["x", "<|im_end|>"]
    assert codec.chat_stops(["x"], ignore_eos=True) == ["x"]  # vLLM's ignore_eos: through the turn's end
    end = other.convert_tokens_to_ids("<|im_end|>")
    seq = {"tokens": [*other.encode("hi there", add_special_tokens=False), end], "logprobs": [-1.0] * 3,
           "text": "", "stop_reason": "stop"}
    choice = w.choice_of(codec, seq, [])
    assert (choice.text, choice.finish_reason, choice.sampled) == ("hi there", "stop", 3)
    assert [t for p in choice.pieces for t in p.tokens] == seq["tokens"][:2]


def test_openai_requests_count_in_the_keys_usage_and_a_spent_budget_refuses_them(server):
    """The core counts every door's requests: the reply's own usage (the door's count) is
    what the key's usage grew by; a budget spent through this door refuses it with 403."""
    carol = new_user(server, "carol-usage")
    reply = carol.client.completions.create(model=TINY, prompt="Once upon", max_tokens=4, n=2, seed=1)
    usage = carol.service.create_rest_client().get_usage()
    assert (usage.prefilled, usage.sampled) == (reply.usage.prompt_tokens, reply.usage.completion_tokens)
    assert usage.trained == 0 and [r.run_id for r in usage.runs] == [None]  # a base model: no run

    server.core.store.set_budget("carol-usage", usage.total)
    with pytest.raises(openai.PermissionDeniedError, match="token budget spent"):
        carol.client.completions.create(model=TINY, prompt="Once upon", max_tokens=4)
    assert carol.service.create_rest_client().get_usage().total == usage.total  # the refused one ran nothing
