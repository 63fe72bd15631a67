"""The agent endpoint: an OpenAI-compatible server (and in-process client) in front of a rollout engine.

    endpoint = AgentEndpoint(engine, manager)           # manager: a TrajectorySink
    token = new_run_token()                             # one per run: required on every route
    api = OpenAIApi(endpoint, model_name="tiny-llama", token=token)
    with EndpointServer(api, port=8000) as server:      # 127.0.0.1 unless told otherwise
        ...                                            # agents: base_url=server.url, api_key=token
"""

from sfhpc.endpoint.api import OpenAIApi
from sfhpc.endpoint.auth import new_run_token
from sfhpc.endpoint.client import AsyncLocalClient, LocalClient
from sfhpc.endpoint.errors import EndpointConfigError, EndpointError
from sfhpc.endpoint.server import TRAJECTORY_HEADER, EndpointServer, build_app, start_site
from sfhpc.endpoint.service import AgentEndpoint, Sampling, TurnRequest, TurnResult
from sfhpc.endpoint.sink import TrajectorySink

__all__ = [
    "TRAJECTORY_HEADER", "AgentEndpoint", "AsyncLocalClient", "EndpointConfigError", "EndpointError",
    "EndpointServer", "LocalClient", "OpenAIApi", "Sampling", "TrajectorySink", "TurnRequest", "TurnResult",
    "build_app", "new_run_token", "start_site",
]
