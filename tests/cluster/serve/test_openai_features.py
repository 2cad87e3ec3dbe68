"""The API's features through the official openai client against a real server: logprobs equal to
transformers', n, best_of, penalties, structured output, and routing between two served models."""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import jsonschema
import openai
import pytest
import torch
from fastapi import FastAPI

from actors.model.loader import load_tokenizer
from cluster.engine.build import local_engine
from cluster.engine.config import SchedulerConfig
from cluster.engine.loop import EngineLoop
from cluster.serve.models import ServedModels
from cluster.serve.openai_api import build_openai_router
from cluster.serve.service import ServiceLimits, SpecService
from speculators.lookahead import LookaheadConfig
from speculators.proposers.prompt_lookup import PromptLookupProposer
from tests.cluster.serve.uvicorn_server import uvicorn_server
from tests.conftest import tiny_pair

pytestmark = pytest.mark.default_model

FIRST, SECOND = "tiny-pld", "tiny-plain"
PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat"
MESSAGES = [{"role": "user", "content": "Say hello to the cat."}]


@dataclass
class TwoModels:
    port: int
    tokenizer: object
    reference: object
    """transformers' model with the weights of FIRST."""
    services: dict[str, SpecService]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def two(default_model_path):
    """Two tiny random Llamas with the default model's tokenizer: FIRST drafts with prompt lookup,
    SECOND (other weights) decodes plainly; one server routes between them by name."""
    tokenizer = load_tokenizer(default_model_path)
    config = SchedulerConfig(max_len=512, max_sequences=6)
    services, loops, reference = {}, [], None
    for seed, name, proposer in ((0, FIRST, PromptLookupProposer()), (1, SECOND, None)):
        model, hf = tiny_pair(seed=seed, dtype=torch.float64, vocab_size=len(tokenizer))
        reference = reference or hf
        loop = EngineLoop(local_engine(model, tokenizer, proposer, config), f"features-{name}")
        loops.append(loop)
        services[name] = SpecService([loop], tokenizer, name, "pld" if proposer else "none", LookaheadConfig(),
                                     ServiceLimits(max_n=8))
    app = FastAPI()
    models = ServedModels(list(services.values()))
    app.include_router(build_openai_router(lambda: models))
    with uvicorn_server(app, "features-server") as port:
        yield TwoModels(port, tokenizer, reference, services)
    for loop in loops:
        loop.stop()


def raw_logprobs(two: TwoModels, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = two.reference(torch.tensor([prompt_ids + output_ids[:-1]])).logits[0, len(prompt_ids) - 1:]
    return logits.double().log_softmax(-1)


# ---- logprobs ----------------------------------------------------------------------------------


def test_completion_logprobs_equal_transformers(two):
    ids = two.tokenizer.encode(PROMPT)
    output_ids = two.reference.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12,
                                        do_sample=False)[0, len(ids):].tolist()
    response = two.client().completions.create(model=FIRST, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3)
    logprobs = response.choices[0].logprobs
    assert logprobs.tokens == [two.tokenizer.decode([token]) for token in output_ids]
    expected = raw_logprobs(two, ids, output_ids)
    for row, token, logprob, top in zip(expected, output_ids, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob == pytest.approx(float(row[token]), abs=1e-5)
        assert len(top) <= 4 and all(any(abs(v - w) < 1e-5 for w in top.values()) for v in row.topk(3).values.tolist())
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    assert response.model_extra["speculation"]["drafted"] > 0  # speculation was on

def test_chat_logprobs_are_the_same_with_speculation_off_and_streamed(two):
    client = two.client()
    request = dict(model=FIRST, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    on = client.chat.completions.create(**request).choices[0].logprobs.content
    off = client.chat.completions.create(**request, extra_body={"speculation": {"method": "off"}}).choices[0].logprobs.content
    streamed = [entry for chunk in client.chat.completions.create(**request, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert len(on) == 12
    for a, b, c in zip(on, off, streamed):
        assert a.token == b.token == c.token and a.bytes
        if a.token.isascii():
            assert bytes(a.bytes).decode() == a.token
        assert a.logprob == pytest.approx(b.logprob, abs=1e-6) and a.logprob == pytest.approx(c.logprob, abs=1e-6)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs] and len(a.top_logprobs) == 2


# ---- n, best_of --------------------------------------------------------------------------------


def test_n_samples_are_independent_choices(two):
    response = two.client().completions.create(model=FIRST, prompt=PROMPT, max_tokens=10, temperature=1.0, n=3, seed=11)
    texts = [choice.text for choice in response.choices]
    assert [choice.index for choice in response.choices] == [0, 1, 2] and len(set(texts)) == 3
    single = two.client().completions.create(model=FIRST, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=11)
    assert single.choices[0].text == texts[0]  # sample i is seeded seed + i
    assert response.usage.completion_tokens == 30 and response.usage.prompt_tokens == len(two.tokenizer.encode(PROMPT))


def test_greedy_n_returns_copies_and_streams_every_choice(two):
    client = two.client()
    response = client.chat.completions.create(model=FIRST, messages=MESSAGES, max_tokens=8, temperature=0, n=2)
    assert len({c.message.content for c in response.choices}) == 1 and len(response.choices) == 2
    finished = {}
    for chunk in client.chat.completions.create(model=FIRST, messages=MESSAGES, max_tokens=8, temperature=1.0, n=3,
                                                stream=True, seed=4):
        for choice in chunk.choices:
            finished[choice.index] = choice.finish_reason or finished.get(choice.index)
    assert finished == {0: "length", 1: "length", 2: "length"}


def test_best_of_keeps_the_likeliest_sample(two):
    client = two.client()
    best = client.completions.create(model=FIRST, prompt=PROMPT, max_tokens=6, temperature=1.0, best_of=4, seed=2,
                                     logprobs=0)
    candidates = client.completions.create(model=FIRST, prompt=PROMPT, max_tokens=6, temperature=1.0, n=4, seed=2,
                                           logprobs=0)
    scores = {c.text: sum(c.logprobs.token_logprobs) for c in candidates.choices}
    assert best.choices[0].text == max(scores, key=scores.get)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=FIRST, prompt=PROMPT, best_of=2, stream=True)
    assert error.value.param == "best_of"


# ---- penalties ---------------------------------------------------------------------------------


def test_penalties_make_output_repeat_less(two):
    """What OpenAI documents: positive presence and frequency penalties make repeated tokens rarer."""
    client = two.client()

    prompt = "a b a b a b a b"

    def repeats(**penalties):  # output tokens seen before, in the prompt or earlier in the output
        response = client.completions.create(model=FIRST, prompt=prompt, max_tokens=48, temperature=0, logprobs=0,
                                             **penalties)
        seen, count = {two.tokenizer.decode([token]) for token in two.tokenizer.encode(prompt)}, 0
        for token in response.choices[0].logprobs.tokens:
            count += token in seen
            seen.add(token)
        return count

    assert repeats(presence_penalty=2.0, frequency_penalty=2.0) < repeats()
    assert repeats(extra_body={"repetition_penalty": 3.0}) < repeats()


# ---- structured output -------------------------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_json_schema_output_validates(two):
    response = two.client().chat.completions.create(
        model=FIRST, messages=[{"role": "user", "content": 'A person as JSON: {"name": "Bo", "age": 3}'}],
        max_tokens=48, temperature=0.7, seed=1, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert "grammar_pruned" in response.model_extra["speculation"]


def test_a_regex_as_an_extra_field(two):
    response = two.client().completions.create(model=SECOND, prompt="Digits:", max_tokens=8, temperature=1.0,
                                               extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    text = response.choices[0].text
    assert response.choices[0].finish_reason == "stop" and len(text) == 6 and text[:3].isdigit() and text[3] == "-"


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_a_bad_grammar_is_a_400_naming_the_field(two, fields, param):
    with pytest.raises(openai.BadRequestError) as error:
        two.client().chat.completions.create(model=FIRST, messages=MESSAGES, max_tokens=4, **fields)
    assert error.value.param == param


# ---- routing -----------------------------------------------------------------------------------


def test_two_models_are_listed_and_routed_by_name(two):
    client = two.client()
    assert [m.id for m in client.models.list().data] == [FIRST, SECOND]
    answers = {name: client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
               for name in (FIRST, SECOND)}
    assert answers[FIRST].choices[0].text != answers[SECOND].choices[0].text  # other weights
    assert answers[SECOND].model == SECOND and answers[SECOND].model_extra["speculation"]["drafted"] == 0
    ids = two.tokenizer.encode(PROMPT)
    for name, answer in answers.items():  # each model's own plain greedy decoding
        assert answer.choices[0].text == two.tokenizer.decode(_plain(two.services[name], ids), skip_special_tokens=True)


def _plain(service: SpecService, ids: list[int]) -> list[int]:
    from cluster.engine.request import GenerationRequest

    loop = service.loops[0]
    done = threading.Event()
    result = []
    loop.submit(GenerationRequest("plain", ids, max_new_tokens=8, speculate=False),
                lambda event: (result.append(event.finished), done.set()) if event.finished else None)
    assert done.wait(60)
    return result[0].token_ids


def test_an_unknown_model_is_a_404_and_a_missing_one_a_400_with_two_models(two):
    with pytest.raises(openai.NotFoundError) as error:
        two.client().completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    assert error.value.body["code"] == "model_not_found" and error.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as error:
        two.client().completions.create(model="", prompt=PROMPT, max_tokens=4)
    assert error.value.param == "model"
