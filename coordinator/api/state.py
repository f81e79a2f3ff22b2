"""What the API's handlers share: the state of the app (the model, its tokenizer, the scheduler,
the limits) and OpenAI's shape of an error."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from agent.api.events import EventHub
from agent.common.http import api_error
from agent.runtime.tokenizer import ChatTokenizer
from coordinator.api.limits import Limiter
from coordinator.batching.batcher import Batcher
from coordinator.batching.scheduler import Scheduler


@dataclass
class ApiState:
    model: str
    tokenizer: ChatTokenizer
    scheduler: Scheduler | Batcher
    api_key: str | None = None
    max_tokens_limit: int = 8192
    context_limit: int = 32768
    events: EventHub | None = None  # the cluster event stream (streams started and finished)
    served_by: Callable[[], list[str]] = field(default=lambda: [])  # the plan's nodes, in stage order
    limiter: Limiter | None = None  # request limits per client (None: none)


STATE = web.AppKey("api_state", ApiState)


def error(
    status: int, message: str, kind: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> web.Response:
    return api_error(status, message, code, kind, param)
