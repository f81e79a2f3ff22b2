"""The request a gateway sends to go on with a streamed answer whose coordinator was lost: the
client's request again, with the seed and the continuation (``lakeshard.continue``: the ids so
far; ``lakeshard.sent``: the characters shown), and whatever else the client asked kept."""

from __future__ import annotations

import json
from typing import Any

from agent.api.resume import Answer

PARTIAL = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]


def again(body: dict[str, Any], ans: Answer) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(ans.continuation(body))
    return out


def test_the_continuation_carries_the_ids_the_characters_and_the_seed() -> None:
    body = {"messages": PARTIAL[:1], "stream": True}
    assert again(body, Answer()) == body  # nothing came yet: the same request
    got = again(body, Answer(ids=[5, 6], sent=4, seed=9))
    assert got == {**body, "seed": 9, "lakeshard": {"continue": [5, 6], "sent": 4}}


def test_what_the_client_asked_of_lakeshard_and_continue_final_message_stay_asked() -> None:
    ans = Answer(ids=[7], sent=2, seed=1)
    top = {"messages": PARTIAL, "stream": True, "continue_final_message": True}
    assert again(top, ans)["continue_final_message"] is True
    inner = {"messages": PARTIAL, "stream": True, "lakeshard": {"continue_final_message": True}}
    assert again(inner, ans)["lakeshard"] == {"continue_final_message": True, "continue": [7], "sent": 2}
    assert inner["lakeshard"] == {"continue_final_message": True}  # (the client's request is left as it was)
