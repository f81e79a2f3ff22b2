"""A completion request, parsed and checked: every field a client sends is validated here, and bad
input is a :class:`BadRequest` naming the field (a 400, never a crash).

Two kinds: a chat completion (``/v1/chat/completions``: messages, through the model's chat
template) and a legacy text completion (``/v1/completions``: a prompt used as raw text). They
share the sampling fields and the rule for parameters this server does not implement: each is
refused by name unless it is at its neutral value (``presence_penalty: 0``, ``tools: []``,
``response_format: {"type": "text"}``...), never accepted and silently ignored. A parameter
OpenAI's API does not have at all is refused too (``unknown_parameter``), as OpenAI does.

Log-probabilities: a chat completion's ``logprobs: true`` (with ``top_logprobs``, 0 to 20
alternatives a token, which needs it) and a legacy completion's integer ``logprobs`` (0 to 20)
ask for every generated token's log-probability, computed on the last stage (``opts["logprobs"]``:
how many alternatives; None: not asked).

One extension is vLLM's: ``continue_final_message: true`` (also taken as
``lakeshard.continue_final_message``) goes on with the final message, which must be the
assistant's, instead of starting a new turn after it (the chat template leaves that message
open). With it, vLLM's ``add_generation_prompt`` may be sent as vLLM requires, ``false``.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from agent.protocol import MAX_TOP_LOGPROBS

CHAT_DEFAULT_MAX_TOKENS = 512
TEXT_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for a legacy completion
MAX_CONTINUE = 1 << 17


class BadRequest(ValueError):
    """A request refused with a 400: ``param`` names the field at fault, ``code`` says how
    (None: a value out of its range or of the wrong type)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


# -- parameters taken as sent but without effect on the answer -----------------------------------

# who asks and what to file the request under: nothing here changes the answer
# (``parallel_tool_calls`` says how tools may be called: without tools, nothing)
NO_EFFECT = frozenset(
    {"user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier", "parallel_tool_calls"}
)


def _none(v: Any) -> bool:
    return v is None


def _falsy(v: Any) -> bool:
    return v is None or v is False or v == 0 or v == [] or v == {} or v == ""


def _zero(v: Any) -> bool:
    return v is None or (isinstance(v, int | float) and not isinstance(v, bool) and v == 0)


# parameters this server does not implement: (their neutral value, why it is refused otherwise:
# a message that names the parameter)
Neutral = Callable[[Any], bool]
TOOLS = "this server does not call tools (no function calling)"
CHAT_REFUSED: dict[str, tuple[Neutral, str]] = {
    "presence_penalty": (_zero, "presence_penalty is not supported; send 0 or leave it out"),
    "frequency_penalty": (_zero, "frequency_penalty is not supported; send 0 or leave it out"),
    "logit_bias": (_falsy, "logit_bias is not supported"),
    "tools": (_falsy, f"tools are not supported: {TOOLS}"),
    "tool_choice": (lambda v: v is None or v == "none", f"tool_choice is not supported: {TOOLS}"),
    "functions": (_falsy, f"functions are not supported: {TOOLS}"),
    "function_call": (lambda v: v is None or v == "none", f"function_call is not supported: {TOOLS}"),
    "response_format": (
        lambda v: v is None or v == {"type": "text"},
        'response_format: only {"type": "text"} is supported (no JSON mode or JSON schema: '
        "the output is not constrained)",
    ),
    "modalities": (lambda v: v is None or v == ["text"], 'modalities: only ["text"] is supported'),
    "audio": (_none, "audio is not supported (no audio output)"),
    "prediction": (_none, "prediction (predicted outputs) is not supported"),
    "reasoning_effort": (_none, "reasoning_effort is not supported: the model does not reason in a hidden channel"),
    "verbosity": (_none, "verbosity is not supported"),
    "web_search_options": (_none, "web_search_options is not supported (no web search)"),
}
TEXT_REFUSED: dict[str, tuple[Neutral, str]] = {
    "presence_penalty": CHAT_REFUSED["presence_penalty"],
    "frequency_penalty": CHAT_REFUSED["frequency_penalty"],
    "logit_bias": CHAT_REFUSED["logit_bias"],
    "echo": (lambda v: v is None or v is False, "echo is not supported"),
    "suffix": (lambda v: v is None or v == "", "suffix is not supported (no fill-in-the-middle)"),
    "best_of": (lambda v: v is None or v == 1, "best_of is not supported: only best_of=1"),
}
# what each kind implements (with "n", "stream" and "stream_options" checked here too; logprobs,
# top_logprobs: below)
SAMPLING = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options"})
CHAT_FIELDS = SAMPLING | {"messages", "max_completion_tokens", "lakeshard", "logprobs", "top_logprobs"}
CHAT_FIELDS |= {"continue_final_message", "add_generation_prompt"}  # (vLLM's: an answer continued)
TEXT_FIELDS = SAMPLING | {"prompt", "logprobs"}


def refuse_unsupported(
    body: dict[str, Any], implemented: frozenset[str], refused: dict[str, tuple[Neutral, str]]
) -> None:
    """Raise :class:`BadRequest` for the first parameter of ``body`` that would change the answer
    but is not implemented (sent at other than its neutral value), or that is unknown."""
    for key, value in body.items():
        if key in implemented or key in NO_EFFECT:
            continue
        rule = refused.get(key)
        if rule is None:
            raise BadRequest(f"unrecognized request argument supplied: {key}", key, "unknown_parameter")
        neutral, why = rule
        if not neutral(value):
            raise BadRequest(why, key, "unsupported_parameter")


# -- the fields both kinds share ------------------------------------------------------------------


def _num(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not (lo <= v <= hi):
        raise BadRequest(f"{key} must be a number between {lo} and {hi}", key)
    return float(v)


def _max_tokens(body: dict[str, Any], key: str, default: int, limit: int) -> int:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not (1 <= v <= limit):
        raise BadRequest(f"{key} must be an integer between 1 and {limit}", key)
    return v


def sampling_opts(body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """What both kinds of completion take alike: n, stop, seed, temperature, top_p, stream."""
    if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):
        raise BadRequest("only n=1 is supported", "n", "unsupported_value")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stops = list(stop)
    else:
        raise BadRequest("stop must be a string or a list of at most 4 strings", "stop")
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbelow(2**31)
    if isinstance(seed, bool) or not isinstance(seed, int) or not (0 <= seed < 2**63):
        raise BadRequest("seed must be a non-negative integer", "seed")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream must be true or false", "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    return {
        "continue": (),  # token ids already generated (a gateway going on after a lost coordinator)
        "sent": 0,  # characters of them the client has already been sent
        "max_tokens": max_tokens,
        "temperature": _num(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _num(body, "top_p", 1.0, 1e-6, 1.0),
        "seed": seed,
        "stop": [s for s in stops if s],
        "stream": bool(stream),
        "include_usage": isinstance(so, dict) and so.get("include_usage") is True,
    }


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


# -- the two kinds ---------------------------------------------------------------------------------


def parse_chat_request(body: Any, limit: int) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """A chat completion's messages (roles system, user, assistant) and options; ``limit``: the
    most ``max_tokens`` (or ``max_completion_tokens``) may ask for."""
    body = _object(body)
    refuse_unsupported(body, CHAT_FIELDS, CHAT_REFUSED)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list", "messages")
    clean = []
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise BadRequest("each message needs a role of system, user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise BadRequest("message content must be a string", "messages")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _max_tokens(body, key, CHAT_DEFAULT_MAX_TOKENS, limit)
    opts = sampling_opts(body, max_tokens)
    opts["continue"], opts["sent"] = continuation(body.get("lakeshard"), max_tokens)
    opts["continue_final"] = continue_final(body, clean)
    opts["logprobs"] = chat_logprobs(body)
    return clean, opts


def parse_text_request(body: Any, limit: int) -> tuple[str, dict[str, Any]]:
    """A legacy completion's prompt (raw text: a string, or a list of one string) and options."""
    body = _object(body)
    refuse_unsupported(body, TEXT_FIELDS, TEXT_REFUSED)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest(
            "prompt must be a string or a list of one string (several prompts, and token ids, are not supported)",
            "prompt",
        )
    opts = sampling_opts(body, _max_tokens(body, "max_tokens", TEXT_DEFAULT_MAX_TOKENS, limit))
    opts["logprobs"] = _top(body, "logprobs")
    return prompt, opts


def _top(body: dict[str, Any], key: str) -> int | None:
    """A count of alternatives a token (0 to MAX_TOP_LOGPROBS), or None when not sent."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"{key} must be an integer between 0 and {MAX_TOP_LOGPROBS}", key)
    return v


def chat_logprobs(body: dict[str, Any]) -> int | None:
    """How many alternatives a chat completion's tokens list with their log-probabilities
    (``top_logprobs``, 0 when not sent), or None when ``logprobs`` is not true. As in OpenAI's
    API, ``top_logprobs`` needs ``logprobs: true``."""
    on = _flag(body.get("logprobs"), "logprobs")
    top = _top(body, "top_logprobs")
    if top and not on:
        raise BadRequest("top_logprobs needs logprobs: true (alternatives come with the tokens' own)", "top_logprobs")
    return (top or 0) if on else None


def _flag(v: Any, name: str) -> bool:
    if v is not None and not isinstance(v, bool):
        raise BadRequest(f"{name} must be true or false", name)
    return bool(v)


def continue_final(body: dict[str, Any], messages: list[dict[str, str]]) -> bool:
    """Whether the answer goes on with the final message (``continue_final_message``, vLLM's
    name, or ``lakeshard.continue_final_message``), which must then be the assistant's. vLLM's
    ``add_generation_prompt`` is taken where it agrees: true (or absent) for a new turn, false
    (or absent) when continuing."""
    lk = body.get("lakeshard")
    inner = lk.get("continue_final_message") if isinstance(lk, dict) else None
    top = _flag(body.get("continue_final_message"), "continue_final_message")
    on = _flag(inner, "lakeshard.continue_final_message") or top
    prompt = body.get("add_generation_prompt")
    if prompt is not None and prompt is not (not on):
        raise BadRequest(
            "add_generation_prompt must be false with continue_final_message (the answer goes on, no new turn "
            "begins) and true without it",
            "add_generation_prompt",
        )
    if on and messages[-1]["role"] != "assistant":
        raise BadRequest(
            "continue_final_message needs the last message to be the assistant's (the answer to continue); "
            f"the last message is the {messages[-1]['role']}'s",
            "continue_final_message" if top else "lakeshard.continue_final_message",
        )
    return on


def continuation(v: Any, max_tokens: int) -> tuple[tuple[int, ...], int]:
    """``lakeshard.continue`` (ids generated so far) and ``lakeshard.sent`` (characters the client
    has), which an agent's gateway sends to go on with an answer whose coordinator was lost."""
    if v is None:
        return (), 0
    if not isinstance(v, dict):
        raise BadRequest("lakeshard must be an object", "lakeshard")
    ids, sent = v.get("continue", []), v.get("sent", 0)
    if not isinstance(ids, list) or len(ids) > min(max_tokens, MAX_CONTINUE):
        raise BadRequest("lakeshard.continue must be a list of at most max_tokens token ids", "lakeshard.continue")
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 31 for i in ids):
        raise BadRequest("lakeshard.continue must hold token ids", "lakeshard.continue")
    if isinstance(sent, bool) or not isinstance(sent, int) or sent < 0:
        raise BadRequest("lakeshard.sent must be a count of characters", "lakeshard.sent")
    return tuple(ids), sent
