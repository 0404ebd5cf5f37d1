"""Registers ``fathom.GenerateService`` with raw request bytes (no deserializer), for Ray
Serve's ``grpc_options.grpc_servicer_functions`` or a plain ``grpc.aio`` server: the service
parses the bytes itself (``app.api.grpc_service``), so a malformed message is answered
``INVALID_ARGUMENT`` with a clear message instead of grpc's ``UNKNOWN`` and a Python trace."""

from __future__ import annotations

from typing import Any

import grpc

from app.grpc.fathom_pb2 import GenerateResponse

SERVICE = "fathom.GenerateService"


def add_GenerateServiceServicer_to_server(servicer: Any, server: Any) -> None:  # noqa: N802
    """What the generated function of the same name does, minus the request deserializer."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=None,
            response_serializer=GenerateResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
