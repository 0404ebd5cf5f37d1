"""The ingress's retry on another rank, over stand-ins of the two Serve
handles (the Serve test kills a real rank; this covers each way a rank can fail): a request
that got no token is retried on another rank, and the failed rank is dropped from the Router;
after a token, a failure ends the stream with a retriable error."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray")
from ray.exceptions import ActorDiedError  # noqa: E402

from app.deployments.client import ServeEngineClient  # noqa: E402
from app.deployments.routing import Decision, RouteQuery  # noqa: E402
from app.engine.admission import EngineUnavailableError, Refusal  # noqa: E402
from app.engine.request import (  # noqa: E402
    ENGINE_FAILED,
    EngineRequest,
    FinishReason,
    RequestOutput,  # noqa: E402
)

REQ = EngineRequest("req-1", (0, 5))
ACK = RequestOutput("req-1")


def tokens(*ids: int, done: bool = False) -> RequestOutput:
    reason = FinishReason.LENGTH if done else None
    return RequestOutput("req-1", token_ids=list(ids), finished=done, finish_reason=reason)


FAILED_STEP = RequestOutput(
    "req-1", finished=True, finish_reason=FinishReason.ERROR, error=f"{ENGINE_FAILED}: boom"
)


class Stream:
    """What ``handle.options(stream=True).generate.remote()`` returns: async iterable +
    cancel."""

    def __init__(self, items: list) -> None:
        self.items, self.cancelled = items, False

    async def _gen(self):
        for it in self.items:
            if isinstance(it, BaseException):
                raise it
            await asyncio.sleep(0)
            yield it

    def __aiter__(self):
        return self._gen()

    def cancel(self) -> None:
        self.cancelled = True


class Call:
    def __init__(self, fn) -> None:
        self.remote = fn


class Ranks:
    """The DPRank handle: rank id -> what its stream yields (an exception raises there)."""

    def __init__(self, plans: dict[str, list]) -> None:
        self.plans, self.calls, self.streams = plans, [], []
        self.generate = Call(self._generate)

    def options(self, stream: bool) -> Ranks:
        return self

    def _generate(self, req: EngineRequest, target: str, cost: float | None = None) -> Stream:
        self.calls.append(target)
        s = Stream(self.plans[target])
        self.streams.append(s)
        return s


class Router:
    def __init__(self, order: list[str]) -> None:
        self.order, self.dropped, self.excludes = order, [], []
        self.choose, self.drop = Call(self._choose), Call(self._drop)

    async def _choose(self, q: RouteQuery) -> Decision | None:
        self.excludes.append(list(q.exclude))
        rid = next((r for r in self.order if r not in q.exclude and r not in self.dropped), None)
        return None if rid is None else Decision(rid, "load")

    async def _drop(self, rid: str) -> None:
        self.dropped.append(rid)


def run(plans: dict[str, list]) -> tuple[list[RequestOutput], Ranks, Router]:
    ranks, router = Ranks(plans), Router(list(plans))
    client = ServeEngineClient(ranks, router)

    async def main() -> list[RequestOutput]:
        return [o async for o in client.generate(REQ)]

    return asyncio.run(main()), ranks, router


# the rank's stream ends with no error and no final delta (seen through Serve when the rank
# is SIGKILLed mid-stream: the stream ended, and the API closed it as a normal finish)
ENDS = "ends"


@pytest.mark.parametrize(
    "failure",
    [ActorDiedError(), Refusal("unavailable", "the engine stopped"), FAILED_STEP, ENDS],
    ids=["rank-died", "engine-stopped", "step-failed", "stream-ended"],
)
def test_failure_before_the_first_token_is_retried_elsewhere(failure):
    first = [failure] if isinstance(failure, Refusal) else [ACK, failure]
    first = [ACK] if failure is ENDS else first
    outs, ranks, router = run({"a": first, "b": [ACK, tokens(1), tokens(2, done=True)]})
    assert [o.token_ids for o in outs] == [[], [1], [2]]  # one ack, b's tokens
    assert outs[-1].finished and ranks.calls == ["a", "b"]
    assert router.dropped == ["a"] and router.excludes == [[], ["a"]]


@pytest.mark.parametrize("failure", [ActorDiedError(), FAILED_STEP, ENDS],
                         ids=["died", "step-failed", "stream-ended"])  # fmt: skip
def test_failure_after_a_token_is_a_retriable_error(failure):
    plan = [ACK, tokens(1)] + ([] if failure is ENDS else [failure])
    ranks, router = Ranks({"a": plan}), Router(["a", "b"])
    client = ServeEngineClient(ranks, router)

    async def main() -> list[RequestOutput]:
        return [o async for o in client.generate(REQ)]

    with pytest.raises(EngineUnavailableError, match="mid-stream.*retry"):
        asyncio.run(main())
    assert ranks.calls == ["a"] and router.dropped == ["a"]  # not retried, but dropped


def test_every_rank_failing_is_unavailable_not_a_hang():
    with pytest.raises(EngineUnavailableError, match="no other engine rank|ranks failed"):
        run({"a": [ActorDiedError()], "b": [ActorDiedError()], "c": [ActorDiedError()]})


def test_overload_and_invalid_are_not_retried():
    outs = None
    with pytest.raises(Exception, match="full") as e:
        outs = run({"a": [Refusal("overloaded", "queue full")], "b": [ACK, tokens(1, done=True)]})
    assert type(e.value).__name__ == "EngineOverloadedError" and outs is None
