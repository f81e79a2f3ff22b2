"""The API's request limits as numbers: defaults and bounds, read by the settings parser and by
the coordinator's API (:mod:`coordinator.api.limits`, which enforces them)."""

from __future__ import annotations

# A non-loopback API is open to the network: without limits one client (a script in a loop,
# a runaway agent) could fill the pipeline's batch and queue for everyone else. 60 requests
# a minute (burst 10) is far above what a person chatting sends and leaves room for tools
# firing a few calls in a row; 4 in flight matches the default --streams 4, so one client may
# fill the batch but not queue ahead of everyone without bound.
NETWORK_RATE = 60
NETWORK_CONCURRENCY = 4
# every request in flight (streamed or waiting for a stream) holds its prompt in memory:
# past this many at once, more get a 429 (an office never gets near it)
TOTAL_INFLIGHT = 64
MAX_CLIENTS = 4096
MAX_RATE = 1_000_000
MAX_CONCURRENCY = 10_000
