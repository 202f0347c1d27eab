"""TokenLogprob <-> duet.worker.v1.TokenLogprob (the Submit stream and the P/D hand-over)."""

from __future__ import annotations

from protos.duet.worker.v1 import worker_pb2
from workers.sample.logprobs import TokenLogprob


def to_proto(lp: TokenLogprob) -> worker_pb2.TokenLogprob:
    return worker_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                   top_logprobs=[worker_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def from_proto(msg: worker_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top_logprobs))
