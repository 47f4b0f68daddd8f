"""A complete external reward service: meshrl.v1.RewardService in ~120 lines of Python.

    python examples/reward_server/server.py --port 50061
    # then, in the meshrl config:
    #   reward:
    #     endpoints:
    #       - address: 127.0.0.1:50061
    #         data_sources: [openai/gsm8k]

Copy this file and replace `score_item` with your reward (a sandbox run, a model call ...). Keep
the contract (see README.md next to this file):
- one result per item, in request order, with the item's `item_id` echoed;
- Score is a pure function of the item: meshrl may send an item again after a timeout;
- a malformed item is INVALID_ARGUMENT (meshrl surfaces it and does not retry); a temporary
  problem (overloaded, a dependency down) is UNAVAILABLE or RESOURCE_EXHAUSTED (meshrl retries
  with backoff and holds the items; it never scores them as zero).

Needs grpcio and meshrl's generated stubs (`pip install meshrl`, or generate them from
protos/meshrl/v1/reward.proto; see README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import os
import re
import signal
from collections.abc import Sequence

import grpc
import grpc.aio

from meshrl.v1 import reward_pb2, reward_pb2_grpc

# ---- the reward: replace this with yours ---------------------------------------------------------

_GSM8K = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _clean(number: str) -> str:
    return number.replace(",", "").replace("$", "").rstrip(".")


def score_item(item: reward_pb2.ScoreItem) -> tuple[float, dict[str, float]]:
    """GSM8K-style: the number after `####` (else the last number in the response) must equal the
    ground truth. Returns (score, named metrics)."""
    m = _GSM8K.search(item.response_text)
    if m is not None:
        answer, formatted = _clean(m.group(1)), 1.0
    else:
        numbers = _NUMBER.findall(item.response_text)
        answer, formatted = (_clean(numbers[-1]) if numbers else None), 0.0
    correct = answer is not None and answer == _clean(item.ground_truth.strip())
    return float(correct), {"acc": float(correct), "format": formatted}


# ---- the service -----------------------------------------------------------------------------------


class RewardService(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, token: str | None = None) -> None:
        self.token = token

    async def Score(self, request: reward_pb2.ScoreRequest, context: grpc.aio.ServicerContext) -> reward_pb2.ScoreResponse:
        if self.token:
            md = dict(context.invocation_metadata() or ())
            if not hmac.compare_digest(md.get("authorization", ""), f"Bearer {self.token}"):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        for i, item in enumerate(request.items):
            if not item.item_id:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"items[{i}].item_id: must be non-empty")
        results = []
        for item in request.items:
            score, metrics = score_item(item)
            results.append(reward_pb2.ScoreResult(item_id=item.item_id, score=score, metrics=metrics))
        return reward_pb2.ScoreResponse(results=results)


async def start_server(
    host: str = "127.0.0.1",
    port: int = 50061,
    *,
    token: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start the service; returns (server, bound port). Port 0 picks a free one."""
    server = grpc.aio.server()
    reward_pb2_grpc.add_RewardServiceServicer_to_server(RewardService(token), server)
    address = f"{host}:{port}"
    if tls_cert and tls_key:
        with open(tls_key, "rb") as k, open(tls_cert, "rb") as c:
            creds = grpc.ssl_server_credentials([(k.read(), c.read())])
        bound = server.add_secure_port(address, creds)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    await server.start()
    return server, bound


async def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="An example meshrl.v1.RewardService.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50061)
    p.add_argument("--token", default=os.environ.get("REWARD_TOKEN"), help="require this bearer token (or REWARD_TOKEN)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain (enables TLS with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key")
    args = p.parse_args(argv)
    server, port = await start_server(args.host, args.port, token=args.token, tls_cert=args.tls_cert, tls_key=args.tls_key)
    print(f"reward server listening on {args.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=2.0)


if __name__ == "__main__":
    asyncio.run(main())
