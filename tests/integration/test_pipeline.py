"""The network pipeline: agent processes on loopback, a coordinator, the OpenAI-compatible API."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from typing import Any

import pytest

from coordinator.batching.scheduler import prefill_chunks
from tests.support.prompts import PROMPTS
from tests.support.reference import reference_answer
from tests.support.served import Served, chat, post_chat
from tests.support.wait import wait_until


def _head_steps(node: str) -> int:
    with urllib.request.urlopen(f"http://{node}/v1/node", timeout=10) as r:
        return int(json.loads(r.read())["stage"]["head_steps"])


def test_three_agents_give_the_whole_model_greedy_tokens(served3: Served, whole_int8, smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    before = _head_steps(served3.nodes[-1])
    for prompt in PROMPTS[:2]:
        got = chat(served3, prompt, max_tokens=48, temperature=0)
        assert got == reference_answer(whole_int8, smollm2_tokenizer, prompt, 48)
        assert len(got) > 20
    # a lone stream's head was computed in two parts, stage 0's beside the last stage's
    assert _head_steps(served3.nodes[-1]) - before >= 2 * 40


LONG_CODE = "\n".join(
    f"def step_{i}(state: dict[str, int], amount: int = {i}) -> dict[str, int]:\n"
    f'    """Move counter {i} forward by amount and record the change."""\n'
    f"    state['counter_{i}'] = state.get('counter_{i}', 0) + amount * {i + 1}\n"
    f"    return state\n"
    for i in range(10)
)


def test_a_long_prompt_prefilled_in_pieces_through_the_ring_gives_the_whole_model_tokens(
    served3: Served,
    whole_int8,  # type: ignore[no-untyped-def]
    smollm2_tokenizer,
) -> None:
    prompt = f"Here is some Python code:\n{LONG_CODE}\nWhich function adds the most per call, and why?"
    n = len(smollm2_tokenizer.chat_ids([{"role": "user", "content": prompt}]))
    assert len(prefill_chunks(n, 3)) >= 3  # sent as several prefill frames at once
    got = chat(served3, prompt, max_tokens=32, temperature=0)
    assert got == reference_answer(whole_int8, smollm2_tokenizer, prompt, 32)
    assert len(got) > 20


def test_concurrent_streams_each_equal_their_solo_run(served3: Served) -> None:
    cases = [
        (PROMPTS[0], {"max_tokens": 40, "temperature": 0}),
        (PROMPTS[1], {"max_tokens": 24, "temperature": 0.8, "seed": 5}),
        (PROMPTS[2], {"max_tokens": 32, "temperature": 1.0, "top_p": 0.9, "seed": 11}),
    ]
    solo = [chat(served3, p, **kw) for p, kw in cases]
    results: list[str | None] = [None] * len(cases)

    def run(i: int) -> None:
        p, kw = cases[i]
        results[i] = chat(served3, p, **kw)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results == solo


def test_openai_client_streams_a_chat_completion(served3: Served) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{served3.api_url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
    msgs = [{"role": "user", "content": "Name three colours of the rainbow."}]
    pieces, finish = [], None
    for chunk in client.chat.completions.create(
        model="smollm2-135m", messages=msgs, stream=True, max_tokens=40, temperature=0
    ):  # type: ignore[arg-type]
        delta = chunk.choices[0].delta.content
        if delta:
            pieces.append(delta)
        finish = chunk.choices[0].finish_reason or finish
    full = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=40, temperature=0)  # type: ignore[arg-type]
    assert len(pieces) > 3
    assert "".join(pieces) == full.choices[0].message.content
    assert finish in ("stop", "length")
    assert full.usage is not None and full.usage.prompt_tokens > 5


def test_openai_client_gets_not_found_for_a_model_not_served(served3: Served) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{served3.api_url}/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=msgs, max_tokens=4)  # type: ignore[arg-type]
    assert e.value.code == "model_not_found"
    assert "smollm2-135m" in e.value.message  # it names the model that is served
    # the API keeps serving the model it has
    ok = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=4)  # type: ignore[arg-type]
    assert ok.choices[0].message.content


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/v1/nope", 404), ("POST", "/v1/models", 405)])
def test_unknown_routes_and_methods_answer_an_openai_json_error(
    served3: Served, method: str, path: str, status: int
) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{served3.api_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:
        if method == "GET":
            client.get(path.removeprefix("/v1"), cast_to=object)
        else:
            client.post(path.removeprefix("/v1"), cast_to=object, body={})
    assert e.value.status_code == status
    assert e.value.response.headers["content-type"].startswith("application/json")
    err = e.value.response.json()["error"]
    assert err["message"] and err["type"]


def test_completion_tokens_count_the_tokens_generated(served3: Served) -> None:
    """usage.completion_tokens is what was generated: never above max_tokens, the same streamed
    (with stream_options.include_usage) as not, and one per streamed token."""
    import openai

    client = openai.OpenAI(base_url=f"{served3.api_url}/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    full = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=48, temperature=0)  # type: ignore[arg-type]
    assert full.choices[0].finish_reason == "length"
    assert full.usage is not None and full.usage.completion_tokens == 48
    chunks, usage = [], None
    for chunk in client.chat.completions.create(
        model="smollm2-135m",
        messages=msgs,  # type: ignore[arg-type]
        max_tokens=48,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            chunks.append(chunk.choices[0].delta.content)
    assert usage is not None, "no usage chunk although the client asked for it"
    assert usage.completion_tokens == 48 and usage.prompt_tokens == full.usage.prompt_tokens
    assert "".join(chunks) == full.choices[0].message.content
    assert len(chunks) <= usage.completion_tokens
    # without include_usage, no usage chunk (as OpenAI)
    plain = client.chat.completions.create(
        model="smollm2-135m", messages=msgs, max_tokens=8, temperature=0, stream=True
    )  # type: ignore[arg-type]
    assert all(c.usage is None for c in plain)


def test_stop_strings_and_max_tokens(served3: Served) -> None:
    status, body = post_chat(
        served3.api_url,
        {
            "messages": [{"role": "user", "content": "Count from 1 to 20, separated by commas."}],
            "temperature": 0,
            "max_tokens": 60,
        },
    )
    assert status == 200
    text = body["choices"][0]["message"]["content"]
    assert "5" in text
    cut = text[: text.index("5")]
    status, body = post_chat(
        served3.api_url,
        {
            "messages": [{"role": "user", "content": "Count from 1 to 20, separated by commas."}],
            "temperature": 0,
            "max_tokens": 60,
            "stop": ["5"],
        },
    )
    assert body["choices"][0]["message"]["content"] == cut
    assert body["choices"][0]["finish_reason"] == "stop"
    status, body = post_chat(
        served3.api_url, {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 3}
    )
    assert body["choices"][0]["finish_reason"] == "length"


def _node_streams(served: Served) -> list[int]:
    out = []
    for node in served.nodes:
        with urllib.request.urlopen(f"http://{node}/v1/node", timeout=5) as r:
            out.append(json.loads(r.read())["stage"]["streams"])
    return out


def test_client_disconnect_cancels_generation_and_frees_streams(served3: Served) -> None:
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "Write a very long essay about the ocean."}],
            "stream": True,
            "max_tokens": 2000,
            "temperature": 0,
        }
    ).encode()
    req = urllib.request.Request(f"{served3.api_url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=60)
    for _ in range(4):
        assert resp.readline()
    assert max(_node_streams(served3)) >= 1
    resp.close()  # the user closes the chat window
    wait_until(
        lambda: _node_streams(served3), 20, what="the stages to let the cancelled stream go", ok=lambda s: max(s) == 0
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "messages must be a non-empty list"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
        ({"messages": [{"role": "user", "content": 5}]}, "content must be a string"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 7}, "temperature must be"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens must be"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 3}, "only n=1"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop must be"),
        ({"messages": [{"role": "user", "content": "hi"}], "seed": -1}, "seed must be"),
    ],
)
def test_bad_requests_get_openai_style_errors(served3: Served, body: dict[str, Any], message: str) -> None:
    status, reply = post_chat(served3.api_url, body)
    assert status == 400
    assert message in reply["error"]["message"]
    assert reply["error"]["type"] == "invalid_request_error"


def test_an_agent_that_hangs_up_on_its_assignment_is_named_with_its_close_code(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A real websocket peer that closes (code 1011) when handed its stage: the coordinator's
    error names the agent and the close code, not only that the connection went."""
    import asyncio

    from aiohttp import web

    from agent.common import aio
    from agent.security.transport import PLAINTEXT
    from coordinator.ring.pipeline import Pipeline, PipelineError, StagePlacement

    (tmp_path / "manifest.json").write_text("{}")

    async def hang_up(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.receive()
        await ws.close(code=1011, message=b"cannot compile")
        return ws

    async def main() -> str:
        app = web.Application()
        app.router.add_get("/ws", hang_up)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        node = f"127.0.0.1:{runner.addresses[0][1]}"  # the free port it bound
        p = Pipeline(
            [StagePlacement(node, tmp_path)],
            export_id="x",
            return_url="ws://127.0.0.1:1/r",
            artifacts_url="http://x",
            transport=PLAINTEXT,
        )
        try:
            await asyncio.wait_for(p.async_start(timeout=10), 20)
        except PipelineError as e:
            return str(e)
        finally:
            await p.async_close()
            await runner.cleanup()
        return "no error"

    msg = aio.run(main())
    assert "127.0.0.1" in msg and "during assignment" in msg and "1011" in msg, msg


@pytest.mark.parametrize("megabytes", [7.5, 2.0])
def test_a_huge_prompt_is_refused_without_holding_up_the_api(served3: Served, megabytes: float) -> None:
    """7.5 MB is refused before tokenizing (it cannot fit); 2 MB must be tokenized to know,
    and that happens off the event loop: other requests are answered meanwhile."""
    import openai

    text = "The quick brown fox jumps over the lazy dog. " * int(megabytes * 2**20 / 45)
    client = openai.OpenAI(base_url=f"{served3.api_url}/v1", api_key="unused", max_retries=0, timeout=120)
    answer: dict[str, Any] = {}

    def post() -> None:
        try:
            client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": text}])
        except openai.APIStatusError as e:
            answer["error"] = e

    t = threading.Thread(target=post)
    t0 = time.monotonic()
    t.start()
    waits = []
    while t.is_alive() and time.monotonic() - t0 < 60:
        s = time.monotonic()
        assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
        waits.append(time.monotonic() - s)
        time.sleep(0.05)  # pacing the other client (the scenario, not a wait): a request every 50 ms
    t.join(60)
    err = answer.get("error")
    assert isinstance(err, openai.BadRequestError), answer
    assert "exceeds the context" in err.message
    assert waits and max(waits) < 1.0, f"/v1/models waited {max(waits, default=0):.2f} s"


def test_serve_exits_within_a_second_of_sigterm_ending_streams_with_an_error(smollm2) -> None:  # type: ignore[no-untyped-def]
    import openai

    s = Served(2, "--model", "smollm2-135m", "--weights", "int8")
    try:
        client = openai.OpenAI(base_url=f"{s.api_url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "Write a long story."}],
            stream=True,
            max_tokens=4000,
        )
        chunks = iter(stream)
        for _ in range(4):
            next(chunks)
        t0 = time.monotonic()
        s.proc.terminate()
        s.proc.wait(timeout=30)
        took = time.monotonic() - t0
        with pytest.raises(openai.APIError) as e:
            for _ in chunks:  # what was sent before the end, then the error
                pass
    finally:
        s.stop()
    assert took < 1.0, f"serve took {took:.2f} s to exit after SIGTERM"
    assert "shutting down" in e.value.message, e.value.message
    s.drained.join(10)
    # an ordinary stop is not cut short (the ring's return links once held every one past its
    # time, and the warning named no reason)
    cut = [line for line in s.output if "shutdown cut short" in line]
    assert not cut, "".join(s.output[-15:])
