"""A tool-using agent with the OpenAI Agents SDK, as its documentation writes one: an `Agent` with a
`function_tool`, run by `Runner`. `python calculator_agents_sdk.py responses` (the default) uses the SDK's
default model class, on the Responses API; `... chat` its chat-completions model class; `... responses
stream` runs the agent with `Runner.run_streamed` (streamed responses) instead of `Runner.run_sync`.

sfhpc starts it per episode with OPENAI_BASE_URL, OPENAI_API_KEY and OPENAI_MODEL set (and the SDK's trace
export off) and the episode's input as one JSON object on stdin; the task's verifier judges the final reply.
"""

import asyncio
import json
import os
import sys

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool
from agents.exceptions import MaxTurnsExceeded
from calculator import calculate as evaluate
from openai import AsyncOpenAI


@function_tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression such as '(3 + 4) * 2' and return the number."""
    return evaluate(expression)


episode = json.load(sys.stdin)
api = sys.argv[1] if len(sys.argv) > 1 else "responses"
client = AsyncOpenAI()  # base URL and key from the environment
model_class = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
agent = Agent(name="solver", tools=[calculate], model=model_class(os.environ["OPENAI_MODEL"], client),
              model_settings=ModelSettings(max_tokens=episode["max_tokens"]))
conversation = [{"role": m["role"], "content": m["content"]} for m in episode["messages"]]


async def streamed() -> None:
    run = Runner.run_streamed(agent, conversation, max_turns=5)
    async for _ in run.stream_events():  # tool calls and text deltas as they come
        pass


try:
    if "stream" in sys.argv[2:]:
        asyncio.run(streamed())
    else:
        Runner.run_sync(agent, conversation, max_turns=5)
except MaxTurnsExceeded:
    print(json.dumps({"reward": 0.0}))  # no answer within five calls
