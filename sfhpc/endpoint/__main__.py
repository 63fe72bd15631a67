"""Serve the agent endpoint on its own: ``python -m sfhpc.endpoint [--port 8000] [--host H --token T]``.

It fronts the scripted test engine (no model is loaded) and an in-memory trajectory manager, so agents
and clients can be tried against the real API without a run. Inside a run, the rollout rank starts the
endpoint with its vLLM engine and the controller's manager instead.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from sfhpc.data.manager import TrajectoryManager
from sfhpc.endpoint.api import OpenAIApi
from sfhpc.endpoint.server import DEFAULT_HOST, start_site
from sfhpc.endpoint.service import AgentEndpoint
from sfhpc.engine.scripted import ScriptedEngine
from sfhpc.errors import SfhpcError

TOKEN_VAR = "SFHPC_ENDPOINT_TOKEN"  # an environment variable keeps the secret out of `ps`


async def serve(args: argparse.Namespace) -> None:
    engine = ScriptedEngine(seed=args.seed, token_delay=args.token_delay, max_model_len=args.max_model_len)
    api = OpenAIApi(AgentEndpoint(engine, TrajectoryManager()), model_name=args.model)
    runner, port = await start_site(api, host=args.host, port=args.port, token=os.environ.get(TOKEN_VAR) or None)
    print(f"sfhpc endpoint: serving '{args.model}' (scripted test engine) at http://{args.host}:{port}/v1",
          flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sfhpc.endpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}); any other "
                                                             f"needs a bearer token in ${TOKEN_VAR}")
    parser.add_argument("--port", type=int, default=8000, help="port (0: a free one)")
    parser.add_argument("--model", default="scripted", help="the model name agents must send")
    parser.add_argument("--seed", type=int, default=0, help="the scripted engine's weights")
    parser.add_argument("--token-delay", type=float, default=0.0, help="seconds per generated token")
    parser.add_argument("--max-model-len", type=int, default=256)
    args = parser.parse_args(argv)
    try:
        asyncio.run(serve(args))
    except SfhpcError as exc:
        print(f"sfhpc: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
