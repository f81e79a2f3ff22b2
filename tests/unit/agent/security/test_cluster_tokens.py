"""Join tokens, durations and the join MACs: table tests of the pure parts of agent.security.tokens."""

from __future__ import annotations

import base64
import hashlib

import pytest

from agent.security import SecurityError, tokens
from agent.security.tokens import JoinToken

CLUSTER = "wlumx4ptzbddkl3znnnn7754bm"
SECRET = bytes(range(16))


def _raw_token(raw: bytes) -> str:
    """A token of exactly ``raw`` (plus a correct check): for bodies the encoder would not make."""
    full = raw + hashlib.sha256(b"lsj1-" + raw).digest()[:4]
    return "lsj1-" + base64.urlsafe_b64encode(full).decode().rstrip("=")


@pytest.mark.parametrize("address", ["127.0.0.1:7700", "10.0.0.21:1", "laptop-7.office.lan:65535", "[fe80::1]:7700"])
def test_token_round_trip(address: str) -> None:
    tok = JoinToken(address, CLUSTER, "0123456789abcdef", SECRET)
    text = tok.encode()
    assert text.startswith("lsj1-") and len(text) < 120
    assert set(text[5:]) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    assert tokens.parse_token(text) == tok
    assert tokens.parse_token(f"  {text}\n") == tok  # pasted with blanks around it


def test_new_tokens_differ() -> None:
    a, b = tokens.new_token("127.0.0.1:7700", CLUSTER), tokens.new_token("127.0.0.1:7700", CLUSTER)
    assert a.token_id != b.token_id and a.secret != b.secret
    assert len(a.secret) == 16 and len(bytes.fromhex(a.token_id)) == 8


GOOD = JoinToken("127.0.0.1:7700", CLUSTER, "0123456789abcdef", SECRET).encode()
FIXED = bytes(16) + bytes(8) + SECRET


def _flip(text: str, i: int) -> str:
    c = "A" if text[i] != "A" else "B"
    return text[:i] + c + text[i + 1 :]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "not a lakeshard join token"),
        ("hello", "not a lakeshard join token"),
        ("lsj2-" + GOOD[5:], "not a lakeshard join token"),
        ("lsj1-", "too short"),
        ("lsj1-abc", "too short"),
        ("lsj1-" + "A" * 500, "too long"),
        ("lsj1-%%%%", "not base64"),
        (GOOD[:-6], "check does not match"),
        (_flip(GOOD, 20), "check does not match"),
        (_flip(GOOD, len(GOOD) - 8), "check does not match"),
        (_raw_token(FIXED + b"no-port"), "is not host:port"),
        (_raw_token(FIXED + b"host:0"), "has no valid port"),
        (_raw_token(FIXED + b"host:99999"), "has no valid port"),
        (_raw_token(FIXED + b"bad host:7700"), "is not host:port"),
        (_raw_token(FIXED + b"\xff\xfe:7700"), "address is not text"),
    ],
)
def test_token_parse_errors(text: str, message: str) -> None:
    with pytest.raises(SecurityError, match=message) as e:
        tokens.parse_token(text)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1s", 1), ("30s", 30), ("30m", 1800), ("24h", 86400), ("7d", 604800), ("2w", 1209600), (" 1H ", 3600)],
)
def test_durations(text: str, seconds: int) -> None:
    assert tokens.parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "not a duration"),
        ("24", "not a duration"),
        ("h", "not a duration"),
        ("1y", "not a duration"),
        ("-1h", "not a duration"),
        ("1.5h", "not a duration"),
        ("1h30m", "not a duration"),
        ("0s", "between 1s and 365d"),
        ("366d", "between 1s and 365d"),
        ("99999999d", "not a duration"),
    ],
)
def test_duration_errors(text: str, message: str) -> None:
    with pytest.raises(SecurityError, match=message):
        tokens.parse_duration(text)


@pytest.mark.parametrize(("text", "ok"), [("1", 1), ("5", 5), ("1000", 1000), ("0", None), ("-1", None), ("x", None)])
def test_uses(text: str, ok: int | None) -> None:
    if ok is None:
        with pytest.raises(SecurityError):
            tokens.parse_uses(text)
    else:
        assert tokens.parse_uses(text) == ok


def test_macs_bind_everything() -> None:
    key = tokens.join_key(SECRET)
    assert key != SECRET and len(key) == 32 and SECRET not in key
    p = tokens.proof(key, "0123456789abcdef", b"csr", bytes(16))
    assert p == tokens.proof(key, "0123456789abcdef", b"csr", bytes(16))
    others = [
        tokens.proof(tokens.join_key(bytes(16)), "0123456789abcdef", b"csr", bytes(16)),
        tokens.proof(key, "0123456789abcdee", b"csr", bytes(16)),
        tokens.proof(key, "0123456789abcdef", b"csr2", bytes(16)),
        tokens.proof(key, "0123456789abcdef", b"csr", bytes(15) + b"\x01"),
    ]
    assert p not in others
    assert tokens.response_mac(key, bytes(16), b"cert") != tokens.response_mac(key, bytes(16), b"cert2")
