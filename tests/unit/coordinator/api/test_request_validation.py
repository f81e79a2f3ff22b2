"""What the API takes of a request, table by table: the parameters it implements, those it takes
without effect, and those it refuses by name (a 400 naming the parameter, never silently
ignored), for chat and legacy text completions alike."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.api.requests import (
    CHAT_DEFAULT_MAX_TOKENS,
    TEXT_DEFAULT_MAX_TOKENS,
    BadRequest,
    parse_chat_request,
    parse_text_request,
)

LIMIT = 8192
MSGS = [{"role": "user", "content": "hi"}]

# (extra fields, the parameter named, its code): refused in a chat completion
CHAT_REFUSED: list[tuple[dict[str, Any], str, str | None]] = [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "unsupported_parameter"),
    ({"tool_choice": "auto"}, "tool_choice", "unsupported_parameter"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "unsupported_parameter"),
    ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    ({"function_call": "auto"}, "function_call", "unsupported_parameter"),
    ({"response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format", "unsupported_parameter"),
    ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter"),
    ({"frequency_penalty": -1}, "frequency_penalty", "unsupported_parameter"),
    ({"presence_penalty": "0"}, "presence_penalty", "unsupported_parameter"),
    ({"top_logprobs": 3}, "top_logprobs", None),  # needs logprobs: true
    ({"logprobs": False, "top_logprobs": 3}, "top_logprobs", None),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", None),
    ({"logprobs": True, "top_logprobs": 2.0}, "top_logprobs", None),
    ({"logprobs": "yes"}, "logprobs", None),
    ({"logprobs": 1}, "logprobs", None),
    ({"logit_bias": {"42": 5}}, "logit_bias", "unsupported_parameter"),
    ({"modalities": ["text", "audio"]}, "modalities", "unsupported_parameter"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "unsupported_parameter"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction", "unsupported_parameter"),
    ({"reasoning_effort": "low"}, "reasoning_effort", "unsupported_parameter"),
    ({"web_search_options": {}}, "web_search_options", "unsupported_parameter"),
    ({"top_k": 40}, "top_k", "unknown_parameter"),  # not OpenAI's: refused as OpenAI refuses it
    ({"repetition_penalty": 1.1}, "repetition_penalty", "unknown_parameter"),
    ({"prompt": "hi"}, "prompt", "unknown_parameter"),  # a legacy completion's field
    ({"n": 2}, "n", "unsupported_value"),
    ({"n": True}, "n", "unsupported_value"),
    ({"max_tokens": 0}, "max_tokens", None),
    ({"max_tokens": LIMIT + 1}, "max_tokens", None),
    ({"max_completion_tokens": 2.5}, "max_completion_tokens", None),
    ({"temperature": 7}, "temperature", None),
    ({"top_p": 0}, "top_p", None),
    ({"seed": -1}, "seed", None),
    ({"stop": 5}, "stop", None),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", None),
    ({"stream": "yes"}, "stream", None),
    ({"stream_options": True}, "stream_options", None),
    ({"lakeshard": {"continue": [-1]}}, "lakeshard.continue", None),
]


@pytest.mark.parametrize(("extra", "param", "code"), CHAT_REFUSED, ids=[p for _, p, _ in CHAT_REFUSED])
def test_a_chat_completion_refuses_by_name(extra: dict[str, Any], param: str, code: str | None) -> None:
    with pytest.raises(BadRequest) as e:
        parse_chat_request({"messages": MSGS, **extra}, LIMIT)
    assert e.value.param == param
    assert e.value.code == code
    assert param.split(".")[0] in str(e.value)  # the message names it too


# neutral values of what is not implemented, and fields without effect on the answer: taken
NEUTRAL: list[dict[str, Any]] = [
    {"presence_penalty": 0, "frequency_penalty": 0.0},
    {"presence_penalty": None, "frequency_penalty": None},
    {"logprobs": False, "top_logprobs": 0},
    {"logprobs": None, "top_logprobs": None},
    {"tools": [], "tool_choice": "none", "parallel_tool_calls": False},
    {"response_format": {"type": "text"}},
    {"logit_bias": {}},
    {"modalities": ["text"]},
    {"n": 1},
    {"n": None},
    {"user": "alice", "store": False, "metadata": {"k": "v"}, "service_tier": "auto"},
    {"stream": None, "stream_options": None},
]


@pytest.mark.parametrize("extra", NEUTRAL)
def test_a_chat_completion_takes_neutral_values(extra: dict[str, Any]) -> None:
    msgs, opts = parse_chat_request({"model": "smollm2-135m", "messages": MSGS, **extra}, LIMIT)
    assert msgs == MSGS
    assert opts["max_tokens"] == CHAT_DEFAULT_MAX_TOKENS
    assert opts["stream"] is False


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        ({}, {"max_tokens": CHAT_DEFAULT_MAX_TOKENS, "temperature": 1.0, "top_p": 1.0, "stop": []}),
        ({"max_tokens": 7, "temperature": 0, "top_p": 0.5}, {"max_tokens": 7, "temperature": 0.0, "top_p": 0.5}),
        ({"max_completion_tokens": 9, "max_tokens": 3}, {"max_tokens": 9}),  # the newer name wins
        ({"max_completion_tokens": None, "max_tokens": 3}, {"max_tokens": 3}),
        ({"stop": "\n", "seed": 5}, {"stop": ["\n"], "seed": 5}),
        ({"stop": ["", "END"]}, {"stop": ["END"]}),
        ({"stream": True, "stream_options": {"include_usage": True}}, {"stream": True, "include_usage": True}),
        ({"stream": True}, {"stream": True, "include_usage": False}),
        ({"lakeshard": {"continue": [1, 2], "sent": 3}}, {"continue": (1, 2), "sent": 3}),
        ({}, {"logprobs": None}),
        ({"logprobs": False, "top_logprobs": 0}, {"logprobs": None}),
        ({"logprobs": True}, {"logprobs": 0}),  # the chosen tokens' own, no alternatives
        ({"logprobs": True, "top_logprobs": 0}, {"logprobs": 0}),
        ({"logprobs": True, "top_logprobs": 20}, {"logprobs": 20}),
    ],
)
def test_a_chat_completions_options(extra: dict[str, Any], want: dict[str, Any]) -> None:
    _, opts = parse_chat_request({"messages": MSGS, **extra}, LIMIT)
    assert {k: opts[k] for k in want} == want


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], None),
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "c1"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ],
)
def test_a_chat_completions_messages_are_checked(body: Any, param: str | None) -> None:
    with pytest.raises(BadRequest) as e:
        parse_chat_request(body, LIMIT)
    assert e.value.param == param


def test_message_roles_and_content_parts() -> None:
    msgs, _ = parse_chat_request(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text"}]},
            ]
        },
        LIMIT,
    )
    assert msgs == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"}]


# -- continuing an answer (vLLM's continue_final_message) ------------------------------------------

PARTIAL = [*MSGS, {"role": "assistant", "content": "Hello th"}]


@pytest.mark.parametrize(
    ("extra", "on"),
    [
        ({}, False),
        ({"continue_final_message": None}, False),
        ({"continue_final_message": False, "add_generation_prompt": True}, False),
        ({"continue_final_message": True}, True),
        ({"continue_final_message": True, "add_generation_prompt": False}, True),  # as vLLM wants it sent
        ({"lakeshard": {"continue_final_message": True}}, True),
        ({"lakeshard": {"continue_final_message": True, "continue": [5], "sent": 1}}, True),  # and a gateway's resume
    ],
)
def test_continue_final_message_goes_on_with_the_assistants_answer(extra: dict[str, Any], on: bool) -> None:
    msgs, opts = parse_chat_request({"messages": PARTIAL, **extra}, LIMIT)
    assert msgs == PARTIAL and opts["continue_final"] is on


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": MSGS, "continue_final_message": True}, "continue_final_message"),
        ({"messages": [*PARTIAL, *MSGS], "continue_final_message": True}, "continue_final_message"),
        ({"messages": MSGS, "lakeshard": {"continue_final_message": True}}, "lakeshard.continue_final_message"),
        ({"messages": PARTIAL, "continue_final_message": "yes"}, "continue_final_message"),
        ({"messages": PARTIAL, "continue_final_message": 1}, "continue_final_message"),
        ({"messages": PARTIAL, "lakeshard": {"continue_final_message": 1}}, "lakeshard.continue_final_message"),
        ({"messages": PARTIAL, "continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
        ({"messages": PARTIAL, "add_generation_prompt": False}, "add_generation_prompt"),
        ({"messages": PARTIAL, "add_generation_prompt": "no"}, "add_generation_prompt"),
    ],
)
def test_continue_final_message_is_refused_by_name_without_an_answer_to_continue(
    body: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as e:
        parse_chat_request(body, LIMIT)
    assert e.value.param == param and param.split(".")[-1] in str(e.value)


def test_a_refusal_says_whose_the_last_message_is() -> None:
    with pytest.raises(BadRequest, match="the last message is the user's"):
        parse_chat_request({"messages": MSGS, "continue_final_message": True}, LIMIT)


# -- legacy text completions ---------------------------------------------------------------------

TEXT_REFUSED: list[tuple[dict[str, Any], str, str | None]] = [
    ({"echo": True}, "echo", "unsupported_parameter"),
    ({"suffix": "}"}, "suffix", "unsupported_parameter"),
    ({"best_of": 3}, "best_of", "unsupported_parameter"),
    ({"logprobs": 21}, "logprobs", None),
    ({"logprobs": True}, "logprobs", None),
    ({"logprobs": -1}, "logprobs", None),
    ({"top_logprobs": 2}, "top_logprobs", "unknown_parameter"),  # a chat completion's
    ({"presence_penalty": 1}, "presence_penalty", "unsupported_parameter"),
    ({"logit_bias": {"1": -100}}, "logit_bias", "unsupported_parameter"),
    ({"messages": MSGS}, "messages", "unknown_parameter"),  # a chat completion's field
    ({"tools": []}, "tools", "unknown_parameter"),
    ({"n": 3}, "n", "unsupported_value"),
    ({"max_tokens": 0}, "max_tokens", None),
    ({"temperature": -1}, "temperature", None),
    ({"stop": [1]}, "stop", None),
]


@pytest.mark.parametrize(("extra", "param", "code"), TEXT_REFUSED, ids=[p for _, p, _ in TEXT_REFUSED])
def test_a_text_completion_refuses_by_name(extra: dict[str, Any], param: str, code: str | None) -> None:
    with pytest.raises(BadRequest) as e:
        parse_text_request({"prompt": "Once upon a time", **extra}, LIMIT)
    assert (e.value.param, e.value.code) == (param, code)
    assert param in str(e.value)


@pytest.mark.parametrize(
    "prompt",
    [None, 5, [], ["a", "b"], [1, 2, 3], [[1, 2]], {"text": "a"}],
    ids=["missing", "number", "empty list", "two prompts", "token ids", "token id lists", "object"],
)
def test_a_text_completions_prompt_is_one_string(prompt: Any) -> None:
    body = {} if prompt is None else {"prompt": prompt}
    with pytest.raises(BadRequest) as e:
        parse_text_request(body, LIMIT)
    assert e.value.param == "prompt"


@pytest.mark.parametrize(
    ("body", "prompt", "want"),
    [
        ({"prompt": "The sky is"}, "The sky is", {"max_tokens": TEXT_DEFAULT_MAX_TOKENS, "stream": False}),
        ({"prompt": ["The sky is"], "max_tokens": 5}, "The sky is", {"max_tokens": 5}),
        (
            {"prompt": "x", "temperature": 0.2, "top_p": 0.9, "seed": 3, "stop": ["."], "stream": True},
            "x",
            {"temperature": 0.2, "top_p": 0.9, "seed": 3, "stop": ["."], "stream": True},
        ),
        (
            {"prompt": "x", "echo": False, "suffix": None, "best_of": 1, "logprobs": None, "user": "u"},
            "x",
            {"continue": ()},
        ),
        ({"prompt": "x", "logprobs": 0, "presence_penalty": 0, "frequency_penalty": 0}, "x", {"sent": 0}),
        ({"prompt": "x"}, "x", {"logprobs": None}),
        ({"prompt": "x", "logprobs": 0}, "x", {"logprobs": 0}),  # the chosen tokens' own
        ({"prompt": "x", "logprobs": 5}, "x", {"logprobs": 5}),
    ],
)
def test_a_text_completions_prompt_and_options(body: dict[str, Any], prompt: str, want: dict[str, Any]) -> None:
    got, opts = parse_text_request(body, LIMIT)
    assert got == prompt
    assert {k: opts[k] for k in want} == want
