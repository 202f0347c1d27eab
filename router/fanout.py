"""``n`` completions of one prompt: fan a GenerateRequest out into n single-choice pipeline streams.

How the prompt is computed once: choice 0 goes first; the other n - 1 start when choice 0's first
message arrives (its worker has then computed the prompt, and its full KV blocks are in that
worker's prefix cache) or when choice 0 ends. The routing policy sends them where the prompt was
sent (``prefix_aware``, the default, matches the blocks it just sent there), so each computes only
the prompt's last, partial block before decoding. With a policy that ignores prefixes the choices
still come out right, each computing the prompt itself.

Seeds: with ``sampling.seed`` = s, choice i samples with seed (s + i) mod 2^63, so the same request
reproduces the same n choices, and choice 0 equals the same request with n = 1. Without a seed the
choices are independent draws.

Every choice is a full pipeline request of its own (admission slot, route, retries, resume, stop
strings, usage): its messages carry ``index`` = i, and its last message its finish_reason and usage.
The merged stream interleaves the choices as their messages arrive. The first error of any choice
(e.g. INVALID_ARGUMENT, which choice 0 meets before the others start) cancels the others (their
worker calls are cancelled, which frees their KV blocks) and ends the call; so does the client
cancelling.

Example: n=3, seed=7 -> choices with seeds 7, 8, 9; the client reads messages with index 0, 1, 2
interleaved, three finish_reasons in all.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Protocol

from protos.duet.v1 import duet_pb2
from router.preprocess import invalid

_SEED_MOD = 2**63


class Generator(Protocol):
    def generate(self, request: duet_pb2.GenerateRequest, *,
                 deadline: float | None = None) -> AsyncGenerator[duet_pb2.GenerateResponse, None]: ...


class _Done:
    """Choice ``index`` finished (its last message was queued before this)."""

    def __init__(self, index: int) -> None:
        self.index = index


def choice_request(request: duet_pb2.GenerateRequest, index: int) -> duet_pb2.GenerateRequest:
    """Choice ``index`` of ``request`` as a single-choice request (derived seed, n cleared)."""
    sub = duet_pb2.GenerateRequest()
    sub.CopyFrom(request)
    sub.n = 0
    if request.sampling.HasField("seed") and index:
        sub.sampling.seed = (request.sampling.seed + index) % _SEED_MOD
    return sub


class FanOut:
    """Wraps a Pipeline (anything with its ``generate``): ``generate`` serves any n in 1..max_n."""

    def __init__(self, pipeline: Generator, max_n: int) -> None:
        self.pipeline = pipeline
        self.max_n = max_n

    async def generate(self, request: duet_pb2.GenerateRequest, *,
                       deadline: float | None = None) -> AsyncGenerator[duet_pb2.GenerateResponse, None]:
        """Stream every choice's messages (``index`` set). Raises RequestError like Pipeline.generate."""
        n = request.n or 1
        if n > self.max_n:
            raise invalid("n", f"must be in 1..{self.max_n} (0 = 1), got {n}")
        if n > 1 and request.HasField("resume"):
            raise invalid("resume", "a request with n > 1 cannot be resumed; resend it whole")
        if n == 1:
            async for response in self.pipeline.generate(request, deadline=deadline):
                yield response
            return
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(choice_request(request, 0), 0, queue, deadline))]
        done = 0
        try:
            while done < n:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if len(tasks) == 1:  # choice 0 has its prompt computed (or is over): start the rest
                    tasks += [asyncio.create_task(self._pump(choice_request(request, i), i, queue, deadline))
                              for i in range(1, n)]
                if isinstance(item, _Done):
                    done += 1
                    continue
                yield item
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(BaseException):
                    await t

    async def _pump(self, request: duet_pb2.GenerateRequest, index: int, queue: asyncio.Queue,
                    deadline: float | None) -> None:
        try:
            async for response in self.pipeline.generate(request, deadline=deadline):
                response.index = index
                queue.put_nowait(response)
            queue.put_nowait(_Done(index))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - RequestError (or a bug): the consumer re-raises it
            queue.put_nowait(e)
