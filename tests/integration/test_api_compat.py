"""The API as the official ``openai`` client uses it, on a real cluster (the session's ``served3``):
a model retrieved by id, the legacy ``/v1/completions`` (raw text, whole and streamed), parameters
that are not implemented refused by name, an answer continued (``continue_final_message``), the
same routes through an agent's local API, and a taken API port said in one line."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.cli import REPO
from tests.support.served import Served

MODEL = "smollm2-135m"
PROMPT = "The three primary colours are"


def _client(served: Served) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{served.api_url}/v1", api_key="unused", max_retries=0, timeout=120)


# -- /v1/models/{id} ----------------------------------------------------------------------------


def test_the_served_model_is_retrieved_by_id_and_any_other_is_not_found(served3: Served) -> None:
    import openai

    client = _client(served3)
    m = client.models.retrieve(MODEL)
    assert (m.id, m.object, m.owned_by) == (MODEL, "model", "lakeshard")
    assert m == client.models.list().data[0]
    for other in ("gpt-4o", "HuggingFaceTB/SmolLM2-135M-Instruct"):  # a slash in an id is still an id
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve(other)
        assert e.value.code == "model_not_found"
        assert e.value.body["param"] == "model"  # type: ignore[index]
        assert other in e.value.message and MODEL in e.value.message  # it names the model that is served


# -- parameters that are not implemented ------------------------------------------------------------

MSGS = [{"role": "user", "content": "Say hi."}]
REFUSED_CHAT = [
    ("tools", {"tools": [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]}),
    ("tool_choice", {"tool_choice": "required"}),
    ("response_format", {"response_format": {"type": "json_object"}}),
    ("presence_penalty", {"presence_penalty": 0.6}),
    ("frequency_penalty", {"frequency_penalty": 0.3}),
    ("logit_bias", {"logit_bias": {"1": 10}}),
    ("n", {"n": 2}),
    ("top_k", {"extra_body": {"top_k": 40}}),  # not OpenAI's at all
]


@pytest.mark.parametrize(("param", "kw"), REFUSED_CHAT, ids=[p for p, _ in REFUSED_CHAT])
def test_a_parameter_that_is_not_implemented_is_refused_by_name(served3: Served, param: str, kw: Any) -> None:
    import openai

    client = _client(served3)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, stream=stream, **kw)  # type: ignore[call-overload]
        assert param in e.value.message
        assert e.value.param == param
        assert e.value.body["type"] == "invalid_request_error"  # type: ignore[index]
        assert e.value.code in ("unsupported_parameter", "unsupported_value", "unknown_parameter")


def test_top_logprobs_without_logprobs_is_refused_by_name(served3: Served) -> None:
    """(``logprobs: true`` with them is answered: test_logprobs.)"""
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        _client(served3).chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=4, logprobs=False, top_logprobs=2
        )
    assert e.value.param == "top_logprobs" and "logprobs: true" in e.value.message


def test_neutral_values_of_what_is_not_implemented_are_answered(served3: Served) -> None:
    """What clients send by default (zero penalties, no tools, text format) is no reason to refuse."""
    client = _client(served3)
    neutral = {"presence_penalty": 0, "frequency_penalty": 0, "logprobs": False, "n": 1, "user": "u"}
    got = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=6, temperature=0, response_format={"type": "text"}, **neutral
    )  # type: ignore[call-overload]
    plain = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    assert got.choices[0].message.content == plain.choices[0].message.content
    assert got.choices[0].logprobs is None


# -- the legacy /v1/completions ----------------------------------------------------------------------


def test_a_legacy_completion_continues_the_raw_text_whole_and_streamed(  # type: ignore[no-untyped-def]
    served3: Served, whole_int8, smollm2_tokenizer
) -> None:
    client = _client(served3)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-") and whole.model == MODEL
    choice = whole.choices[0]
    assert choice.finish_reason in ("length", "stop") and choice.logprobs is None
    # the prompt is raw text (no chat template): the whole model's greedy continuation of its ids
    ids = smollm2_tokenizer.text_ids(PROMPT)
    ref = whole_int8.generate(ids, max_tokens=12, stop_ids=smollm2_tokenizer.stop_ids)
    assert choice.text == smollm2_tokenizer.decode(ref.tokens)
    assert len(choice.text) > 5
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), len(ref.tokens))
    # a list of one string is the same prompt; streamed, the same text piece by piece
    assert client.completions.create(model=MODEL, prompt=[PROMPT], max_tokens=12, temperature=0).choices[0].text == (
        choice.text
    )
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 3 and "".join(texts) == choice.text
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(ref.tokens)


def test_a_legacy_completions_sampling_seed_and_stop(served3: Served) -> None:
    client = _client(served3)
    kw: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16}
    a = client.completions.create(**kw, temperature=1.0, top_p=0.9, seed=7).choices[0].text
    b = client.completions.create(**kw, temperature=1.0, top_p=0.9, seed=7).choices[0].text
    assert a == b and a  # seeded sampling repeats
    greedy = client.completions.create(**kw, temperature=0).choices[0]
    cut = greedy.text.strip()[:1] or "e"  # a stop string the greedy text holds
    stopped = client.completions.create(**kw, temperature=0, stop=[cut]).choices[0]
    assert stopped.finish_reason == "stop"
    assert cut not in stopped.text and greedy.text.startswith(stopped.text)
    # without max_tokens: OpenAI's default for a legacy completion, 16
    default = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", temperature=0)
    assert default.usage is not None and default.usage.completion_tokens <= 16


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": PROMPT, "echo": True}, "echo"),
        ({"prompt": PROMPT, "suffix": "!"}, "suffix"),
        ({"prompt": PROMPT, "best_of": 2}, "best_of"),
        ({"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ({"prompt": PROMPT, "presence_penalty": 1.0}, "presence_penalty"),
        ({"prompt": PROMPT, "max_tokens": 10**6}, "max_tokens"),
    ],
)
def test_a_legacy_completion_refuses_by_name(served3: Served, kw: dict[str, Any], param: str) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        _client(served3).completions.create(model=MODEL, **kw)
    assert e.value.param == param and param in e.value.message


def test_a_legacy_completion_of_another_model_is_not_found(served3: Served) -> None:
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        _client(served3).completions.create(model="gpt-3.5-turbo-instruct", prompt=PROMPT, max_tokens=2)
    assert e.value.code == "model_not_found"


# -- continuing an answer (vLLM's continue_final_message) -----------------------------------------

QUESTION = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]
N, K = 24, 9  # the answer's tokens, and where it is cut


def test_continue_final_message_goes_on_with_the_same_answer_exactly(served3: Served) -> None:
    """Greedy: an answer cut after K tokens and continued for N - K is the uninterrupted N-token
    answer; the continuation's prompt is the question's plus the K tokens (no end of turn, no new
    turn between them), whole and streamed."""
    client = _client(served3)
    kw: dict[str, Any] = {"model": MODEL, "temperature": 0}
    whole = client.chat.completions.create(messages=QUESTION, max_tokens=N, **kw)  # type: ignore[arg-type]
    cut = client.chat.completions.create(messages=QUESTION, max_tokens=K, **kw)  # type: ignore[arg-type]
    assert whole.choices[0].finish_reason == cut.choices[0].finish_reason == "length"
    full, part = whole.choices[0].message.content or "", cut.choices[0].message.content or ""
    assert full.startswith(part) and len(part) > 10
    asked = [*QUESTION, {"role": "assistant", "content": part}]
    more = client.chat.completions.create(
        messages=asked,  # type: ignore[arg-type]
        max_tokens=N - K,
        extra_body={"continue_final_message": True},
        **kw,
    )
    rest = more.choices[0].message.content or ""
    assert part + rest == full and len(rest) > 10
    assert more.usage is not None and cut.usage is not None
    assert more.usage.prompt_tokens == cut.usage.prompt_tokens + K
    assert more.usage.completion_tokens == N - K
    streamed = client.chat.completions.create(
        messages=asked,  # type: ignore[arg-type]
        max_tokens=N - K,
        stream=True,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},  # (as vLLM's clients send it)
        **kw,
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == rest
    # without it, the same messages get a new answer after the assistant's, not the rest of it
    after = client.chat.completions.create(messages=asked, max_tokens=N - K, **kw)  # type: ignore[arg-type]
    assert after.usage is not None and after.usage.prompt_tokens > more.usage.prompt_tokens


def test_continue_final_message_without_an_assistant_message_last_is_refused_by_name(served3: Served) -> None:
    import openai

    client = _client(served3)
    for msgs in (QUESTION, [*QUESTION, {"role": "assistant", "content": "Because"}, *QUESTION]):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(
                    model=MODEL,
                    messages=msgs,  # type: ignore[arg-type]
                    max_tokens=4,
                    stream=stream,
                    extra_body={"continue_final_message": True},
                )
            assert e.value.param == "continue_final_message"
            assert "continue_final_message" in e.value.message and "assistant" in e.value.message


# -- the same routes through an agent's local API (its gateway) -------------------------------------


class _Coordinated:
    """What an agent's local API needs of its agent, where ``served`` is the coordinator."""

    def __init__(self, api: str, session: Any) -> None:
        self.api, self.session, self.transport, self.stopping = api, session, None, False

    def coordinator_target(self) -> Any:
        from agent.api.gateway import Target

        return Target("coordinator", api=self.api)

    def is_member_address(self, ip: str) -> bool:
        return False


@pytest.fixture
async def local_api(served3: Served) -> Any:
    """An agent's real local API app (its routes in their order), forwarding to ``served3``."""
    import aiohttp
    from aiohttp import web

    from agent.api.local import make_local_app

    async with aiohttp.ClientSession() as session:
        runner = web.AppRunner(make_local_app(_Coordinated(served3.api_url, session)))  # type: ignore[arg-type]
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            yield f"http://127.0.0.1:{runner.addresses[0][1]}"
        finally:
            await runner.cleanup()


async def test_an_agents_local_api_forwards_a_model_and_legacy_completions(local_api: str) -> None:
    import aiohttp
    import openai

    client = openai.AsyncOpenAI(base_url=f"{local_api}/v1", api_key="unused", max_retries=0, timeout=120)
    assert (await client.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-4o")
    whole = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    streamed = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
    pieces = [c.choices[0].text async for c in streamed if c.choices]
    assert "".join(pieces) == whole.choices[0].text and whole.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, messages=MSGS, presence_penalty=1)  # type: ignore[arg-type]
    assert e.value.param == "presence_penalty"
    # the local API's own /v1/models/pulls is still its own (not a model id for the coordinator)
    async with aiohttp.ClientSession() as s, s.get(f"{local_api}/v1/models/pulls") as r:
        assert r.status == 200 and "pulls" in await r.json()


# -- a taken API port -------------------------------------------------------------------------------


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_serve_on_a_taken_api_port_says_so_in_one_line(taken_port: int) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "agent", "serve", "--nodes", "127.0.0.1:9", "--insecure", "--api-port", str(taken_port)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines == [
        f"lakeshard: error: the API cannot listen on 127.0.0.1:{taken_port} (Address already in use); "
        "another program holds it: give this one another --api-port"
    ], r.stderr


async def test_a_coordinator_whose_api_port_is_taken_fails_before_it_plans(smollm2, taken_port: int) -> None:  # type: ignore[no-untyped-def]
    """The elected coordinator's start too (``serve.api_port``): at once, with its own fix."""
    from agent.common.ports import ListenError
    from agent.export.exporter import ExportOptions
    from agent.security.transport import PLAINTEXT
    from coordinator.service.config import ServeConfig
    from coordinator.service.coordinator import Coordinator

    fix = "give this agent another --serve-api-port (or serve.api_port in its settings)"
    cfg = ServeConfig(["127.0.0.1:9"], smollm2, ExportOptions(weights="int8"), transport=PLAINTEXT, api_port=taken_port)
    cfg.api_port_fix = fix
    coord = Coordinator(cfg)
    try:
        with pytest.raises(ListenError) as e:
            await coord.async_start()
    finally:
        await coord.async_stop()
    assert str(e.value).endswith(f"another program holds it: {fix}")
    assert coord.pipeline is None  # nothing was planned or assigned
