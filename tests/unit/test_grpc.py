"""The gRPC service on a real grpc.aio server over a real tiny engine: the HTTP API's keys,
limits, defaults and validation, with gRPC status codes; its proto held to the sampling-field
table."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor

from app.api import ApiConfig, FrontDoor
from app.api.grpc_service import GenerateService
from app.deployments.engine_host import LocalEngineClient
from app.engine.request import SamplingParams
from app.engine.validation import (
    BODY,
    GRPC,
    Bias,
    Bool,
    Float,
    Int,
    Stops,
    TokenIds,
    wire_fields,
)
from app.grpc import fathom_pb2 as pb
from app.grpc import fathom_pb2_grpc as pbg
from app.grpc.raw import add_GenerateServiceServicer_to_server
from tests.ports import free_port
from tests.unit.test_api import MODEL, engine  # noqa: F401 (fixture)

KEY = "k-123"
AUTH = (("authorization", f"Bearer {KEY}"),)
METHOD = "/fathom.GenerateService/Generate"


class _Servicer:
    def __init__(self, service: GenerateService) -> None:
        self.service = service

    async def Generate(self, request, context):  # noqa: N802
        async for out in self.service.generate(request, context):
            yield out


class GrpcServer:
    """A grpc.aio server with the service, on its own event loop thread."""

    def __init__(self, service: GenerateService) -> None:
        self.port = free_port()
        self.service = service
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: grpc.aio.Server | None = None

    async def _start(self) -> None:
        self.server = grpc.aio.server()
        add_GenerateServiceServicer_to_server(_Servicer(self.service), self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()

    def __enter__(self) -> GrpcServer:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def client(engine) -> LocalEngineClient:  # noqa: F811
    return LocalEngineClient(engine)


@pytest.fixture(scope="module")
def service(tiny_ckpt, engine, client) -> GenerateService:  # noqa: F811
    cfg = FrontDoor(
        served_model_names=(MODEL,),
        tokenizer_path=f"{tiny_ckpt('v41')}/tokenizer.json",
        context_limit=engine.core.max_model_len,
        options=ApiConfig(max_prompt_tokens=2000, api_keys=(KEY,), default_max_tokens=5),
        vocab_size=engine.core.model.cfg.vocab_size,
    )
    return GenerateService(cfg, client, engine.core.model.cfg.bos_token_id, app_name="fathom")


@pytest.fixture(scope="module")
def channel(service) -> Iterator[grpc.Channel]:
    with GrpcServer(service) as srv, grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel) -> pbg.GenerateServiceStub:
    return pbg.GenerateServiceStub(channel)


def ids_request(**kw) -> pb.GenerateRequest:
    kw.setdefault("sampling", pb.SamplingOptions(max_tokens=3, ignore_eos=True))
    kw.setdefault("model", MODEL)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[0, 5, 9]), **kw)


def call(stub, req, metadata=AUTH) -> tuple[list[pb.GenerateResponse], grpc.RpcError | None]:
    outs: list[pb.GenerateResponse] = []
    try:
        for o in stub.Generate(req, metadata=metadata, timeout=60):
            outs.append(o)
    except grpc.RpcError as e:
        return outs, e
    return outs, None


def test_streams_and_applies_the_default_max_tokens(stub):
    outs, err = call(stub, ids_request())
    assert err is None and outs[-1].finish_reason == "length"
    assert outs[-1].completion_tokens == 3 == sum(len(o.token_ids) for o in outs)
    text = pb.GenerateRequest(model=MODEL, text="hello there",
                              sampling=pb.SamplingOptions(ignore_eos=True))  # fmt: skip
    outs, err = call(stub, text, metadata=(("x-api-key", KEY),))
    assert err is None and outs[-1].completion_tokens == 5  # api.default_max_tokens, not 16
    assert outs[-1].prompt_tokens > 1


def test_logit_bias_takes_effect(stub):
    """A +100 bias makes its token the greedy choice at every step; the same request without
    the map decodes other tokens."""
    greedy = pb.SamplingOptions(max_tokens=4, ignore_eos=True, temperature=0)
    plain, err = call(stub, ids_request(sampling=greedy))
    assert err is None
    tokens = [t for o in plain for t in o.token_ids]
    target = next(t for t in range(5, 50) if t not in tokens)
    biased = pb.SamplingOptions(max_tokens=4, ignore_eos=True, temperature=0,
                                logit_bias={target: 100.0})  # fmt: skip
    outs, err = call(stub, ids_request(sampling=biased))
    assert err is None and [t for o in outs for t in o.token_ids] == [target] * 4


@pytest.mark.parametrize(
    ("metadata", "words"),
    [((), "missing API key"), ((("authorization", "Bearer nope"),), "invalid API key")],
)
def test_api_keys(stub, metadata, words):
    outs, err = call(stub, ids_request(), metadata=metadata)
    assert err is not None and err.code() is grpc.StatusCode.UNAUTHENTICATED
    assert words in err.details() and not any(o.token_ids for o in outs)


BAD = [
    ("unknown-model", ids_request(model="gpt-9"), grpc.StatusCode.NOT_FOUND, "gpt-9"),
    ("no-prompt", pb.GenerateRequest(model=MODEL), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ("empty-text", pb.GenerateRequest(model=MODEL, text=""), grpc.StatusCode.INVALID_ARGUMENT,
     "text"),
    ("out-of-vocab", pb.GenerateRequest(model=MODEL, token_ids=pb.TokenIds(ids=[0, 10**6])),
     grpc.StatusCode.INVALID_ARGUMENT, "vocab"),
    ("top-p-0", ids_request(sampling=pb.SamplingOptions(top_p=0)),
     grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("max-tokens-0", ids_request(sampling=pb.SamplingOptions(max_tokens=0)),
     grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ("max-tokens-over-context", ids_request(sampling=pb.SamplingOptions(max_tokens=10**9)),
     grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ("stop-ids-oov", ids_request(sampling=pb.SamplingOptions(stop_token_ids=[10**6])),
     grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids"),
    ("bias-oov", ids_request(sampling=pb.SamplingOptions(logit_bias={10**6: 1.0})),
     grpc.StatusCode.INVALID_ARGUMENT, "logit_bias"),
    ("bias-over-100", ids_request(sampling=pb.SamplingOptions(logit_bias={7: 101.0})),
     grpc.StatusCode.INVALID_ARGUMENT, "logit_bias"),
    ("prompt-too-long", pb.GenerateRequest(model=MODEL, token_ids=pb.TokenIds(ids=[5] * 2001)),
     grpc.StatusCode.INVALID_ARGUMENT, "limit is 2000"),
    ("long-client-id", ids_request(request_id="x" * 300), grpc.StatusCode.INVALID_ARGUMENT,
     "request_id"),
]  # fmt: skip


@pytest.mark.parametrize(("req", "code", "words"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests_get_status_codes(stub, req, code, words):
    outs, err = call(stub, req)
    assert err is not None and err.code() is code, err
    assert words in err.details()
    assert outs[-1].finish_reason == "error" and words in outs[-1].error  # also in-band


def test_malformed_protobuf_is_invalid_argument(channel):
    raw = channel.unary_stream(METHOD, request_serializer=None,
                               response_deserializer=pb.GenerateResponse.FromString)  # fmt: skip
    with pytest.raises(grpc.RpcError) as e:
        list(raw(b"\x12\xff\xff\xff\xff\x0f", metadata=AUTH, timeout=30))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed GenerateRequest" in e.value.details()


def test_wrong_application_is_not_found(stub):
    _, err = call(stub, ids_request(), metadata=(*AUTH, ("application", "other")))
    assert err is not None and err.code() is grpc.StatusCode.NOT_FOUND
    assert "other" in err.details()


def test_overloaded_and_draining(stub, client, service):
    service.in_flight.max_requests = 0  # the ingress's own bound (shared with HTTP)
    try:
        _, shed = call(stub, ids_request())
    finally:
        service.in_flight.max_requests = None
    assert shed is not None and shed.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert service.in_flight.requests == 0
    client.max_pending = 0
    try:
        _, full = call(stub, ids_request())
    finally:
        client.max_pending = None
    client.drain()
    try:
        _, down = call(stub, ids_request())
    finally:
        client.drain(False)
    assert full is not None and full.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert down is not None and down.code() is grpc.StatusCode.UNAVAILABLE
    assert call(stub, ids_request())[1] is None


def test_same_client_id_twice_at_once(stub):
    long = pb.SamplingOptions(max_tokens=20, ignore_eos=True)
    calls = [stub.Generate(ids_request(request_id="same", sampling=long), metadata=AUTH,
                           timeout=60) for _ in range(3)]  # fmt: skip
    for c in calls:
        outs = list(c)
        assert outs[-1].completion_tokens == 20 and outs[-1].request_id == "same"


def test_proto_sampling_options_match_the_table():
    """The proto is compiled ahead of time, so nothing derives it from the sampling-field
    table: SamplingOptions must hold exactly the table's gRPC fields, each of the table's kind
    (unsigned only where the bound is >= 0), and a scalar without presence must default to the
    table's default (an unset field then means the same on both sides)."""
    table = {f.name: f for f in wire_fields(SamplingParams, GRPC)}
    proto = {d.name: d for d in pb.SamplingOptions.DESCRIPTOR.fields}
    assert set(proto) == set(table)
    fd = FieldDescriptor
    unsigned = {fd.TYPE_UINT32, fd.TYPE_UINT64, fd.TYPE_FIXED32, fd.TYPE_FIXED64}
    ints = unsigned | {fd.TYPE_INT32, fd.TYPE_INT64, fd.TYPE_SINT32, fd.TYPE_SINT64}
    kinds = {  # table kind -> (proto types, repeated)
        Float: ({fd.TYPE_FLOAT, fd.TYPE_DOUBLE}, False),
        Int: (ints, False),
        Bool: ({fd.TYPE_BOOL}, False),
        Stops: ({fd.TYPE_STRING}, True),
        TokenIds: (ints, True),
        Bias: ({fd.TYPE_MESSAGE}, True),  # map<uint32, float>
    }
    for name, f in table.items():
        d, check = proto[name], f.spec.check
        assert f.spec.wire[GRPC] == BODY, name
        types, repeated = kinds[type(check)]
        assert d.type in types and d.is_repeated == repeated, name
        if d.type in unsigned and isinstance(check, Int):
            assert check.lo >= 0, name
        if isinstance(check, Bias):  # a map of unsigned token id -> float bias
            entry = d.message_type
            assert entry.GetOptions().map_entry, name
            assert entry.fields_by_name["key"].type in unsigned, name
            assert entry.fields_by_name["value"].type in {fd.TYPE_FLOAT, fd.TYPE_DOUBLE}, name
        if not repeated and not d.has_presence:
            assert getattr(pb.SamplingOptions(), name) == f.default, name
