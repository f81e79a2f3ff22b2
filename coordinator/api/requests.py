"""A chat completion request, parsed and checked: every field a client sends is validated here,
and bad input is a :class:`BadRequest` naming the field (a 400, never a crash)."""

from __future__ import annotations

import secrets
from typing import Any

from coordinator.api.state import ApiState


class BadRequest(ValueError):
    pass


def _num(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not (lo <= v <= hi):
        raise BadRequest(f"{key} must be a number between {lo} and {hi}")
    return float(v)


def parse_chat_request(body: Any, st: ApiState) -> tuple[list[dict[str, str]], dict[str, Any]]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list")
    clean = []
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise BadRequest("each message needs a role of system, user or assistant")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise BadRequest("message content must be a string")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is supported")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = 512
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not (1 <= max_tokens <= st.max_tokens_limit):
        raise BadRequest(f"max_tokens must be an integer between 1 and {st.max_tokens_limit}")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stops = list(stop)
    else:
        raise BadRequest("stop must be a string or a list of at most 4 strings")
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbelow(2**31)
    if isinstance(seed, bool) or not isinstance(seed, int) or not (0 <= seed < 2**63):
        raise BadRequest("seed must be a non-negative integer")
    cont, sent = continuation(body.get("lakeshard"), max_tokens)
    opts = {
        "continue": cont,  # token ids already generated (a gateway going on after a lost coordinator)
        "sent": sent,  # characters of them the client has already been sent
        "max_tokens": max_tokens,
        "temperature": _num(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _num(body, "top_p", 1.0, 1e-6, 1.0),
        "seed": seed,
        "stop": [s for s in stops if s],
        "stream": bool(body.get("stream", False)),
    }
    return clean, opts


MAX_CONTINUE = 1 << 17


def continuation(v: Any, max_tokens: int) -> tuple[tuple[int, ...], int]:
    """``lakeshard.continue`` (ids generated so far) and ``lakeshard.sent`` (characters the client
    has), which an agent's gateway sends to go on with an answer whose coordinator was lost."""
    if v is None:
        return (), 0
    if not isinstance(v, dict):
        raise BadRequest("lakeshard must be an object")
    ids, sent = v.get("continue", []), v.get("sent", 0)
    if not isinstance(ids, list) or len(ids) > min(max_tokens, MAX_CONTINUE):
        raise BadRequest("lakeshard.continue must be a list of at most max_tokens token ids")
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 31 for i in ids):
        raise BadRequest("lakeshard.continue must hold token ids")
    if isinstance(sent, bool) or not isinstance(sent, int) or sent < 0:
        raise BadRequest("lakeshard.sent must be a count of characters")
    return tuple(ids), sent
