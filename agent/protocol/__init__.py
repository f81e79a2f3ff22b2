"""Every wire and control message, typed and frozen, in one package, with the frame codec.

``codec``: the frame format, field checks and the type registry; ``data``: the ring's
messages (fwd, ids, passed, close, error, assign); ``batch``: micro-batches of many streams for paged stages;
``head``: the head-part request and answer; ``logprobs``: chosen tokens' log-probabilities;
``control``: agent-to-agent beats and votes (signed in a :class:`Sealed` envelope in a
cluster with credentials); ``probe``: link round trips; ``events``: the
cluster event stream (JSON, for node maps and trays).
"""

from agent.protocol.batch import Batch, BatchIds, Part, batch_rows
from agent.protocol.codec import (
    DTYPES,
    MAGIC,
    MAX_FRAME,
    MAX_HEADER,
    MAX_TOKENS_PER_FRAME,
    REGISTRY,
    VERSION,
    Message,
    ProtocolError,
    decode,
    encode,
)
from agent.protocol.control import Ack, Beat, DeviceOffer, Sealed, StageReport, Vote, VoteRequest
from agent.protocol.data import Assign, Assigned, Close, Error, Fwd, Ids, Passed, SamplingSpec, tensor
from agent.protocol.head import Head, HeadTop
from agent.protocol.logprobs import MAX_TOP_LOGPROBS, TokenLogprobs
from agent.protocol.probe import Ping, Pong

__all__ = [
    "DTYPES",
    "MAGIC",
    "MAX_FRAME",
    "MAX_HEADER",
    "MAX_TOKENS_PER_FRAME",
    "MAX_TOP_LOGPROBS",
    "REGISTRY",
    "VERSION",
    "Ack",
    "Assign",
    "Assigned",
    "Batch",
    "BatchIds",
    "Beat",
    "Close",
    "DeviceOffer",
    "Error",
    "Fwd",
    "Head",
    "HeadTop",
    "Ids",
    "Message",
    "Part",
    "Passed",
    "Ping",
    "Pong",
    "ProtocolError",
    "SamplingSpec",
    "Sealed",
    "StageReport",
    "TokenLogprobs",
    "Vote",
    "VoteRequest",
    "batch_rows",
    "decode",
    "encode",
    "tensor",
]
