"""``lakeshard chat``: a terminal client of the coordinator's OpenAI-compatible API."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator


def stream_chat(
    url: str, messages: list[dict[str, str]], *, max_tokens: int, temperature: float, api_key: str | None = None
) -> Iterator[str]:
    """Yield text deltas of a streamed chat completion."""
    # no "model": the coordinator answers with the one it serves
    body = json.dumps(
        {"messages": messages, "stream": True, "max_tokens": max_tokens, "temperature": temperature}
    ).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(f"{url.rstrip('/')}/v1/chat/completions", body, headers, method="POST")
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for choice in chunk.get("choices", []):  # a usage chunk has none
                delta = choice["delta"].get("content")
                if delta:
                    yield delta


def run_chat(args: argparse.Namespace) -> int:
    history: list[dict[str, str]] = []

    def ask(text: str) -> None:
        history.append({"role": "user", "content": text})
        parts = []
        for d in stream_chat(
            args.url, history, max_tokens=args.max_tokens, temperature=args.temperature, api_key=args.api_key
        ):
            sys.stdout.write(d)
            sys.stdout.flush()
            parts.append(d)
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(parts)})

    try:
        if args.once is not None:
            ask(args.once)
            return 0
        print("lakeshard chat: type a message, Ctrl-D to quit", file=sys.stderr)
        while True:
            try:
                text = input("> ")
            except EOFError:
                return 0
            if text.strip():
                ask(text)
    except urllib.error.HTTPError as e:
        print(
            f"lakeshard: error: the coordinator answered {e.code}: {e.read().decode(errors='replace')}", file=sys.stderr
        )
        return 2
    except (urllib.error.URLError, ConnectionError) as e:
        print(f"lakeshard: error: cannot reach the coordinator at {args.url}: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"lakeshard: error: {e}", file=sys.stderr)
        return 2
