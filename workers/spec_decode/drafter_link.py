"""DrafterLink: a target's one ``Rounds`` stream to one drafter replica (drafter.proto).

``send`` puts a round on the stream and returns a future of its response; a reader thread resolves
the futures as responses arrive (matched by round id). The stream stays open for as long as the
target uses the drafter: a round costs one message each way, not a call. When the stream ends (the
drafter died or restarted, the network broke, ``close``) every pending future fails with
``LinkDown`` and the link is dead for good; the proposer opens a new one to reconnect.

Example::

    link = DrafterLink("10.0.0.7:40111", target="decode-0")
    fut = link.send([drafter_pb2.DraftItem(request_id="r1", full_context=True, new_token_ids=ctx, num_tokens=4)])
    fut.result(timeout=2.0).drafts[0].token_ids     # [..4 drafts..]
    link.release(["r1"]); link.close()
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future

import grpc

from protos.duet.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from workers.spec_decode.drafter_service import GRPC_OPTIONS

logger = logging.getLogger(__name__)


class LinkDown(Exception):
    """The stream to the drafter ended; the message says how."""


class DrafterLink:
    def __init__(self, endpoint: str, target: str = "") -> None:
        self.endpoint = endpoint
        self.target = target
        self.incarnation = ""  # from the first response; "" until then
        self.error: str | None = None  # why the link is down, once it is
        self._channel = grpc.insecure_channel(endpoint, options=GRPC_OPTIONS)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._rounds = itertools.count(1)
        self._outbox.put(drafter_pb2.RoundRequest(target=target))  # hello: names the target in the drafter's log
        self._call = drafter_pb2_grpc.DrafterStub(self._channel).Rounds(self._requests())
        self._reader = threading.Thread(target=self._read, name=f"drafter-link-{endpoint}", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.error is None

    def send(self, items: list[drafter_pb2.DraftItem], release: Sequence[str] = ()) -> Future:
        """One round (its items, and releases to apply before them); -> Future[RoundResponse]."""
        fut: Future = Future()
        round_id = next(self._rounds)
        with self._lock:
            if self.error is not None:
                fut.set_exception(LinkDown(self.error))
                return fut
            self._pending[round_id] = fut
        self._outbox.put(drafter_pb2.RoundRequest(round=round_id, items=items, release=release))
        return fut

    def release(self, request_ids: list[str]) -> None:
        """Free these requests' drafter state (no response)."""
        if self.error is None:
            self._outbox.put(drafter_pb2.RoundRequest(release=request_ids))

    def close(self, wait_s: float = 2.0) -> None:
        """End the stream after what is queued (releases) has gone out; rounds still pending fail."""
        self._outbox.put(None)  # half-close: the drafter reads the rest, then ends its side
        self._reader.join(timeout=wait_s)
        self._fail("closed by the target")
        self._call.cancel()
        self._channel.close()

    def _requests(self) -> Iterator[drafter_pb2.RoundRequest]:
        while (msg := self._outbox.get()) is not None:
            yield msg

    def _read(self) -> None:
        try:
            for resp in self._call:
                self.incarnation = resp.incarnation
                with self._lock:
                    fut = self._pending.pop(resp.round, None)
                if fut is not None:
                    fut.set_result(resp)
            self._fail("the drafter ended the stream")
        except grpc.RpcError as e:
            self._fail(f"{e.code().name}: {e.details()}")
        except Exception as e:  # a bug here must still fail the waiting rounds
            logger.exception("drafter link to %s: reader failed", self.endpoint)
            self._fail(repr(e))

    def _fail(self, why: str) -> None:
        with self._lock:
            if self.error is None:
                self.error = why
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(LinkDown(why))
        self._outbox.put(None)  # ends the request iterator (gRPC's sending thread)
