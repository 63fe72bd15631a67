"""The agent program of the timing scale's ``agent`` workload (`sfhpc bench pipeline --timing-workload agent`).

A multi-turn agent as a user brings one: a program of its own that reads its episodes on stdin (one JSON line
each, ``agent.serve``), calls the OpenAI chat API at the episode's URL several times, hands a tool's result back
between calls, and prints its reward. It imports nothing from sfhpc, nor any package beyond the standard library
(so the benchmark runs without the agents' extra). Each reply's length is drawn from the workload's long tail
(P(N >= n) = (min / n) ** alpha, capped), seeded by the episode's seed (the same episodes in every mode of one
seed), and the test engine writes every reply to it.

    timing_agent.py TURNS MIN_TOKENS MAX_TOKENS ALPHA
"""

from __future__ import annotations

import json
import random
import sys
import urllib.request


def chat(base_url: str, key: str, messages: list[dict], max_tokens: int) -> str:
    body = json.dumps({"model": "policy", "messages": messages, "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(f"{base_url}/chat/completions", data=body, headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"] or ""


def reply_tokens(draw: random.Random, low: int, high: int, alpha: float) -> int:
    """A reply's length: P(N >= n) = (low / n) ** alpha, at most `high`."""
    return min(high, int(low * (1.0 - draw.random()) ** (-1.0 / alpha)))


def main(argv: list[str]) -> None:
    turns, low, high, alpha = int(argv[0]), int(argv[1]), int(argv[2]), float(argv[3])
    for line in sys.stdin:
        episode = json.loads(line)
        draw = random.Random(episode.get("seed", episode["episode_id"]))  # the same episodes in every mode
        messages = list(episode["messages"])
        for turn in range(turns):
            reply = chat(episode["base_url"], episode["api_key"], messages, reply_tokens(draw, low, high, alpha))
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": f"tool result {turn + 1}: ok"}]
        print(json.dumps({"episode_id": episode["episode_id"], "reward": draw.random()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
