"""One-line errors: a port that cannot be listened on, and an exception named in a log line
(``shutdown cut short: ...`` once logged an empty reason for a TimeoutError)."""

from __future__ import annotations

import socket

import pytest

from agent.common.ports import ListenError, bind_error, listen_error, port_taken
from agent.node.shutdown import describe


@pytest.mark.parametrize(
    ("e", "said"),
    [
        (TimeoutError(), "TimeoutError"),  # str() is empty: the type alone
        (ValueError(""), "ValueError"),
        (ConnectionResetError("the peer went"), "ConnectionResetError: the peer went"),
        (RuntimeError("the ring broke"), "RuntimeError: the ring broke"),
    ],
)
def test_an_exception_is_named_even_without_a_message(e: BaseException, said: str) -> None:
    assert describe(e) == said


def test_a_taken_port_is_found_and_said_in_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
        s.listen()
        e = bind_error("127.0.0.1", port)
    assert e is not None and port_taken(e)
    err = listen_error("the API", "127.0.0.1", port, e, "give this one another --api-port")
    assert isinstance(err, ListenError) and isinstance(err, OSError)  # what the agent's CLI catches
    assert str(err) == (
        f"the API cannot listen on 127.0.0.1:{port} (Address already in use); give this one another --api-port"
    )
    assert "\n" not in str(err)


def test_a_free_port_binds() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    assert bind_error("127.0.0.1", port) is None


def test_an_address_not_on_this_machine_is_not_called_taken() -> None:
    e = bind_error("192.0.2.1", 0)  # TEST-NET-1: on no interface here
    assert e is not None and not port_taken(e)
