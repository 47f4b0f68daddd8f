"""The verifiers agent as an HTTP service (`agent.endpoint`): verifiers is imported and the
environment built once, then every POST {prompt, base_url, api_key, session_id} that meshrl sends
per sample plays that sample (agent.py's `play`: verifiers' rollout through the session, the
rubric's reward to /finish) and answers 200 when it is done, or 500 with the error. Cheaper than
`agent.command` when samples are many: one interpreter instead of one per sample. In .venv-verifiers:

    .venv-verifiers/bin/python examples/verifiers_agent/server.py --port 8400 &
    meshrl train configs/examples/tool_add.yaml actor_rollout_ref.rollout.multi_turn.enable=false \\
        agent.endpoint=http://127.0.0.1:8400/rollout

It prints `listening on http://HOST:PORT/rollout` once it accepts requests (--port 0: a free port).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import traceback
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
from addition_env import load_environment
from agent import play


def build_app() -> web.Application:
    env = load_environment(num_examples=1)

    async def rollout(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            prompt, base_url, api_key = body["prompt"], body["base_url"], body["api_key"]
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"the body needs prompt, base_url and api_key: {exc!r}"}, status=400)
        try:
            reward = await play(prompt, base_url, api_key, env)
        except Exception as exc:  # noqa: BLE001 - the sample's failure, reported to meshrl with its reason
            traceback.print_exc()
            return web.json_response({"error": repr(exc)}, status=500)
        return web.json_response({"reward": reward})

    app = web.Application()
    app.router.add_post("/rollout", rollout)
    return app


async def main() -> None:
    ap = argparse.ArgumentParser(description="the verifiers agent as an agent.endpoint service")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: a free port (printed)")
    args = ap.parse_args()
    runner = web.AppRunner(build_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"listening on http://{args.host}:{port}/rollout", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
