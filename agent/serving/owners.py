"""Stream ownership on a stage: which connection may touch which stream.

A stream belongs to the connection whose ``Fwd`` started it (the coordinator's link to stage 0,
the previous stage's link to the others). Only that connection may continue, reset or close it;
another connection that names the stream is refused with ``not_owner`` and the stream goes on
untouched. Once the owner's connection has closed, a new ``start`` may claim the stream (a
coordinator that reconnected). The one exception is the ring's link back to stage 0 (the last
stage's ``Fwd.auto`` steps, a connection opened with ``X-Lakeshard-Link: loop``): it may only
continue an owned stream that its owner put on ``auto``, one step at a time, with the next
``seq`` and one ``auto`` less than the step before (so it can neither start, rewind nor
prolong a stream). A micro-batch's parts are admitted one by one, each as a Fwd of its
stream (:meth:`Owners.admit_part`); a part that forks another stream (shares its KV head) must
own that stream too. When a connection closes, the streams it owns are closed too (their
KV state freed along the ring), so a peer cannot fill a stage with streams and leave.
Everything is checked on the event loop when a frame arrives, before it is queued for the
compute thread; the table is bounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from agent.protocol import Close, Error, Fwd, Part, ProtocolError

LINK_HEADER = "X-Lakeshard-Link"  # "loop": the last stage's link back to stage 0
MAX_OWNED = 4096  # streams remembered (live ones are bounded by the stage's own MAX_STREAMS)


class Conn(Protocol):
    @property
    def closed(self) -> bool: ...


@dataclass
class _Owned:
    conn: Conn
    seq: int
    auto: int


class Owners:
    def __init__(self, limit: int = MAX_OWNED) -> None:
        self.limit = limit
        self._streams: dict[str, _Owned] = {}
        self.refused = 0  # frames refused for naming another connection's stream

    def __len__(self) -> int:
        return len(self._streams)

    def owner(self, stream: str) -> Conn | None:
        o = self._streams.get(stream)
        return None if o is None else o.conn

    def admit_fwd(self, fwd: Fwd, conn: Conn, loop: bool) -> None:
        """Claim or check ``fwd``'s stream for ``conn``; ProtocolError ``not_owner`` otherwise."""
        self.admit(fwd.stream, fwd.seq, fwd.start, fwd.auto, conn, loop)

    def admit_part(self, part: Part, conn: Conn, loop: bool) -> None:
        """A micro-batch's part, as a Fwd of its stream; a stream not held here (never started,
        or ended) is refused with ``unknown_stream`` unless the part starts it."""
        if not part.start and part.stream not in self._streams:
            raise ProtocolError(
                "unknown_stream",
                f"unknown stream {part.stream[:128]!r} (start it with start=true)",
                part.stream,
                part.seq,
            )
        if part.fork is not None:  # its KV would be read: the source must be this connection's own
            o = self._streams.get(part.fork)
            if o is None:
                raise ProtocolError(
                    "unknown_stream", f"unknown stream {part.fork[:128]!r} to fork", part.stream, part.seq
                )
            if o.conn is not conn:
                self._refuse(part.stream, part.seq, f"cannot fork {part.fork[:128]!r}, another connection's stream")
        self.admit(part.stream, part.seq, part.start, 0, conn, loop)

    def admit(self, stream: str, seq: int, start: bool, auto: int, conn: Conn, loop: bool) -> None:
        o = self._streams.get(stream)
        if start:
            if loop or (o is not None and o.conn is not conn and not o.conn.closed):
                self._refuse(stream, seq, "is another connection's")
            if o is None and len(self._streams) >= self.limit:
                self._prune()
                if len(self._streams) >= self.limit:
                    raise ProtocolError("too_many_streams", "this stage tracks too many streams", stream, seq)
            self._streams[stream] = _Owned(conn, seq, auto)
            return
        if o is None:  # not (or no longer) here: the stage answers unknown_stream
            return
        follows = loop and o.auto > 0 and seq == o.seq + 1 and auto == o.auto - 1
        if o.conn is not conn and not follows:
            self._refuse(stream, seq, "is another connection's")
        o.seq, o.auto = seq, auto

    def admit_end(self, msg: Close | Error, conn: Conn) -> bool:
        """Whether ``conn`` may end ``msg``'s stream (and pass the message on); the owner's end
        forgets the stream. False for a stream not held here (nothing to end, nothing sent on);
        ProtocolError for a stream-less error frame or another connection's stream."""
        if msg.stream is None:
            raise ProtocolError("bad_field", "an error frame sent to a stage must name its stream")
        o = self._streams.get(msg.stream)
        if o is None:
            return False
        if o.conn is not conn:
            self._refuse(msg.stream, None, "is another connection's")
        del self._streams[msg.stream]
        return True

    def may_fail(self, stream: str, conn: Conn | None, loop: bool) -> bool:
        """Whether a refused frame of ``stream`` from ``conn`` (None: this stage's own step)
        may fail the stream for everyone: only its owner's frames (or the loop's) can."""
        o = self._streams.get(stream)
        if conn is None or (o is not None and (o.conn is conn or loop)):
            self._streams.pop(stream, None)
            return True
        return False

    def release(self, conn: Conn) -> list[str]:
        """Forget the streams ``conn`` owns (its connection has closed): they are to be closed."""
        gone = [s for s, o in self._streams.items() if o.conn is conn]
        for s in gone:
            del self._streams[s]
        return gone

    def clear(self) -> None:
        self._streams.clear()

    def _prune(self) -> None:
        for s in [s for s, o in self._streams.items() if o.conn.closed]:
            del self._streams[s]

    def _refuse(self, stream: str, seq: int | None, why: str) -> None:
        self.refused += 1
        raise ProtocolError("not_owner", f"stream {stream[:128]!r} {why}", stream, seq)
