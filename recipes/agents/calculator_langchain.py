"""A tool-using agent with LangChain: `ChatOpenAI(...).bind_tools([calculate])`, the loop its tool-calling
guide writes: invoke, run the calls, append the `ToolMessage`s, invoke again until the model answers.

sfhpc starts it per episode with OPENAI_BASE_URL, OPENAI_API_KEY and OPENAI_MODEL set (and LangSmith's
tracing off) and the episode's input as one JSON object on stdin; the task's verifier judges the final reply.
"""

import json
import os
import sys

from calculator import calculate as evaluate
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI


@tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression such as '(3 + 4) * 2' and return the number."""
    return evaluate(expression)


episode = json.load(sys.stdin)
kinds = {"system": SystemMessage, "user": HumanMessage, "assistant": AIMessage}
messages = [kinds[m["role"]](content=m["content"]) for m in episode["messages"]]
llm = ChatOpenAI(model=os.environ["OPENAI_MODEL"], max_tokens=episode["max_tokens"], max_retries=0)
llm_with_tools = llm.bind_tools([calculate])
for _ in range(5):
    reply = llm_with_tools.invoke(messages)
    messages.append(reply)
    if not reply.tool_calls:
        break
    for call in reply.tool_calls:
        messages.append(ToolMessage(calculate.invoke(call["args"]), tool_call_id=call["id"]))
