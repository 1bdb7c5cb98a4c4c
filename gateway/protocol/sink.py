"""`EventSink`: where the session core's output goes. The core emits typed objects (protocol messages, batches of
audio frames); a sink turns them into a wire: the native transport writes JSON and the binary header, a compat adapter
translates the typed fields into its own protocol. Nothing on the way is serialised to be parsed again."""

from __future__ import annotations

from typing import Protocol

from gateway.protocol.frames import AudioPackets
from gateway.protocol.server_messages import ServerMessage


class EventSink(Protocol):
    """How a session reaches its client. `message` and `audio` may block while the client is not reading (the session
    bounds that wait by its stall timeout).

    Optional: `def send_ready(self) -> bool`, True when a send now completes without waiting for the client (the
    session then arms no stall timer for it); `def audio_now(self, packets: AudioPackets) -> bool`, `audio` done
    synchronously (outside any task: a turn's first frame as its encoder answers) when the client takes it without
    waiting, else nothing done and False."""

    async def message(self, msg: ServerMessage) -> None:
        """One protocol message (session.started, context.done, error, ...)."""
        ...

    async def audio(self, packets: AudioPackets) -> None:
        """One batch of a turn's consecutive audio frames, in as few writes as the wire allows."""
        ...

    async def close(self, code: int, reason: str) -> None:
        """End the connection with a WebSocket close code and reason."""
        ...

    def abort(self) -> None:
        """Drop the connection now (the client stopped reading)."""
        ...
