"""A tool-using agent with plain `openai`: it offers the policy one function, `calculate`, runs the calls
the model makes and sends the results back, until the model answers without a call (at most 4 calls).

sfhpc starts it per episode with OPENAI_BASE_URL, OPENAI_API_KEY and OPENAI_MODEL set and the episode's
input (the task's opening messages, the reply budget) as one JSON object on stdin. It prints nothing of
its own: the task's verifier judges the final reply.
"""

import json
import os
import sys

import openai
from calculator import TOOL, calculate

episode = json.load(sys.stdin)
client = openai.OpenAI()  # base URL and key from the environment
messages = list(episode["messages"])
for _ in range(5):
    reply = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages, tools=[TOOL],
                                           max_tokens=episode["max_tokens"])
    message = reply.choices[0].message
    if not message.tool_calls:
        break
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        arguments = json.loads(call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(arguments.get("expression"))})
