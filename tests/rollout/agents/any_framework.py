"""Plays each episode with one of the shipped tool-using example agents, in turn: plain `openai`, the OpenAI
Agents SDK on its Responses model and on its chat-completions model, LangChain, the Agents SDK streamed. It
notes which played which episode (``LOG``: ``<episode id> <example>`` lines) and then becomes that example
(exec), stdin untouched.

    any_framework.py LOG
"""

import fcntl
import json
import os
import sys
from pathlib import Path

AGENTS = Path(__file__).resolve().parents[3] / "recipes" / "agents"
EXAMPLES = (["calculator_openai.py"], ["calculator_agents_sdk.py", "responses"], ["calculator_agents_sdk.py", "chat"],
            ["calculator_langchain.py"], ["calculator_agents_sdk.py", "responses", "stream"])

log = sys.argv[1]
episode_id = json.loads(os.environ["SFHPC_EPISODE"])["episode_id"]
with open(log, "a+") as notes:
    fcntl.flock(notes, fcntl.LOCK_EX)  # the count of lines so far chooses the example: each in turn
    notes.seek(0)
    example = EXAMPLES[len(notes.read().splitlines()) % len(EXAMPLES)]
    notes.write(f"{episode_id} {' '.join(example)}\n")
os.execv(sys.executable, [sys.executable, str(AGENTS / example[0]), *example[1:]])
