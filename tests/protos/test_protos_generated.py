"""The checked-in stubs match the .proto files, import cleanly, and carry the documented semantics
(presence of optional fields, oneof prompt, server streaming over a real in-process channel)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from protos import generate
from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


def test_checked_in_stubs_are_up_to_date():
    problems = generate.check()
    assert not problems, "\n".join(problems)


def test_check_cli_exit_code():
    proc = subprocess.run([sys.executable, "-m", "protos.generate", "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "up to date" in proc.stdout


def test_check_reports_drift_missing_and_stale(tmp_path):
    root = tmp_path / "protos"
    shutil.copytree(generate.PROTO_ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    assert generate.check(root) == []
    (root / "duet/v1/duet_pb2.py").write_text("# edited by hand\n")
    (root / "duet/worker/v1/worker_pb2.pyi").unlink()
    (root / "duet/v1/old_pb2.py").write_text("")
    problems = "\n".join(generate.check(root))
    assert "duet/v1/duet_pb2.py: differs" in problems
    assert "duet/worker/v1/worker_pb2.pyi: missing" in problems
    assert "duet/v1/old_pb2.py: stale" in problems


def test_descriptor_names_are_canonical_paths():
    # Reflection and other-language clients see duet/v1/duet.proto, not a repo-specific path.
    assert duet_pb2.DESCRIPTOR.name == "duet/v1/duet.proto"
    assert duet_pb2.DESCRIPTOR.package == "duet.v1"
    assert worker_pb2.DESCRIPTOR.name == "duet/worker/v1/worker.proto"
    assert worker_pb2.DESCRIPTOR.package == "duet.worker.v1"


def test_generate_request_round_trip():
    req = duet_pb2.GenerateRequest(
        messages=duet_pb2.ChatMessages(messages=[
            duet_pb2.ChatMessage(role="system", content="Be brief."),
            duet_pb2.ChatMessage(role="user", content="Héllo, 世界"),
        ]),
        sampling=duet_pb2.SamplingParams(max_tokens=32, temperature=0.0, seed=7, stop=["\n\n"],
                                         stop_token_ids=[2], ignore_eos=True),
        request_id="client-1",
        model="SmolLM2-135M-Instruct",
    )
    back = duet_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back == req
    assert back.WhichOneof("input") == "messages"
    assert [m.content for m in back.messages.messages] == ["Be brief.", "Héllo, 世界"]
    s = back.sampling
    # Explicit temperature 0 (greedy) is distinguishable from unset; unset top_p is not 0.
    assert s.HasField("temperature") and s.temperature == 0.0
    assert not s.HasField("top_p")
    assert s.HasField("max_tokens") and s.max_tokens == 32
    assert s.HasField("seed") and s.seed == 7
    assert list(s.stop) == ["\n\n"] and list(s.stop_token_ids) == [2] and s.ignore_eos


def test_prompt_oneof_is_exclusive():
    req = duet_pb2.GenerateRequest(prompt="hi")
    req.prompt_token_ids.ids.extend([1, 2, 3])  # setting another member clears `prompt`
    back = duet_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back.WhichOneof("input") == "prompt_token_ids"
    assert back.prompt == "" and list(back.prompt_token_ids.ids) == [1, 2, 3]
    assert duet_pb2.GenerateRequest().WhichOneof("input") is None  # no prompt at all


def test_finish_reason_presence():
    delta = duet_pb2.GenerateResponse(request_id="r", text="Hi", token_ids=[5])
    assert not delta.HasField("finish_reason") and not delta.HasField("usage")
    last = duet_pb2.GenerateResponse(request_id="r", finish_reason=duet_pb2.FINISH_REASON_STOP,
                                     usage=duet_pb2.Usage(prompt_tokens=4, completion_tokens=1))
    back = duet_pb2.GenerateResponse.FromString(last.SerializeToString())
    assert back.HasField("finish_reason") and back.finish_reason == duet_pb2.FINISH_REASON_STOP
    assert back.usage.prompt_tokens == 4
    assert duet_pb2.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"
    # The router maps worker enums by value; keep them aligned.
    assert dict(duet_pb2.FinishReason.items()) == dict(worker_pb2.FinishReason.items())


def test_worker_messages_round_trip():
    report = worker_pb2.LoadReport(worker_id="w0", incarnation="abc", num_running=3, outstanding_tokens=2**40,
                                   kv_block_size=16, kv_blocks_total=1024, kv_blocks_used=10)
    assert worker_pb2.LoadReport.FromString(report.SerializeToString()) == report
    sub = worker_pb2.SubmitRequest(request_id="r1", prompt_token_ids=[1, 2, 3],
                                   sampling=worker_pb2.SamplingParams(max_tokens=4, temperature=0.0))
    back = worker_pb2.SubmitRequest.FromString(sub.SerializeToString())
    assert back == sub and not back.sampling.HasField("seed")


class _EchoDuet(duet_pb2_grpc.DuetServicer):
    """Streams the prompt's token ids back one per message."""

    def Generate(self, request, context):
        ids = list(request.prompt_token_ids.ids)
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            yield duet_pb2.GenerateResponse(
                request_id=request.request_id, text=f"<{t}>", token_ids=[t],
                finish_reason=duet_pb2.FINISH_REASON_LENGTH if last else None,
                usage=duet_pb2.Usage(prompt_tokens=len(ids), completion_tokens=len(ids)) if last else None)

    def ListModels(self, request, context):
        return duet_pb2.ListModelsResponse(models=[duet_pb2.ModelInfo(name="m", is_default=True, max_model_len=8)])


class _Worker(worker_pb2_grpc.WorkerServicer):
    def Abort(self, request, context):
        return worker_pb2.AbortResponse(found=request.request_id == "known")


@pytest.fixture
def channel():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    duet_pb2_grpc.add_DuetServicer_to_server(_EchoDuet(), server)
    worker_pb2_grpc.add_WorkerServicer_to_server(_Worker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield ch
    server.stop(grace=None)


def test_services_over_a_real_channel(channel):
    stub = duet_pb2_grpc.DuetStub(channel)
    req = duet_pb2.GenerateRequest(prompt_token_ids=duet_pb2.TokenIds(ids=[7, 8, 9]), request_id="x")
    msgs = list(stub.Generate(req, timeout=10))
    assert "".join(m.text for m in msgs) == "<7><8><9>"
    assert [m.HasField("finish_reason") for m in msgs] == [False, False, True]
    assert msgs[-1].usage.completion_tokens == 3
    assert stub.ListModels(duet_pb2.ListModelsRequest(), timeout=10).models[0].is_default

    worker = worker_pb2_grpc.WorkerStub(channel)
    assert worker.Abort(worker_pb2.AbortRequest(request_id="known"), timeout=10).found
    with pytest.raises(grpc.RpcError) as err:  # unimplemented methods fail loudly
        worker.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
