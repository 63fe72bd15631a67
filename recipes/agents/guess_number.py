"""An agent program for the guess-number recipe: plain `openai`, nothing of sfhpc.

It reads episodes, one JSON object per line on stdin, and plays each against the episode's own URL
(`base_url`, with the run's token as `api_key`): every call it makes is recorded in the episode's
trajectory. The program plays the environment itself: it knows the secret digit (the problem's data),
answers each guess with "higher" or "lower" and asks again. It ends each episode with the line
{"episode_id": ..., "reward": ..., "turn_rewards": [...]}: per guess, 1 when the hints so far allowed it
(the recipe's `credit: turn` trains on both).

Written as a loop over stdin, it serves both ways sfhpc runs agent programs: one program per episode (one
line, then the end of stdin), or, with `agent.serve: true` in the recipe, one long-lived program per worker
slot that plays episodes one after another, so that Python and `openai` start once, not once per episode.
"""

import json
import sys

import openai

clients = {}  # one client per endpoint, reused: its connections too
for line in sys.stdin:
    episode = json.loads(line)
    root = episode["base_url"].split("/episodes/")[0]
    if root not in clients:
        clients[root] = openai.OpenAI(base_url=episode["base_url"], api_key=episode["api_key"])
    client = clients[root].with_options(base_url=episode["base_url"])
    secret = int(episode["problem"]["data"])
    messages = list(episode["messages"])
    reward, per_guess, low, high = 0.0, [], 0, 9
    for turn in range(1, 9):
        reply = client.chat.completions.create(model=episode["model"], messages=messages,
                                               max_tokens=episode["max_tokens"])
        said = reply.choices[0].message.content or ""
        guess = said.strip()
        number = int(guess) if guess.isascii() and guess.isdigit() else None
        per_guess.append(1.0 if number is not None and low <= number <= high else 0.0)
        if number == secret:
            reward = 1.0 - 0.1 * (turn - 1)
            break
        if number is not None and number < secret:
            low = max(low, number + 1)
        elif number is not None:
            high = min(high, number - 1)
        hint = "?" if number is None else "higher" if number < secret else "lower"
        # The reply goes back as the model wrote it: an edited history would fork the trajectory.
        messages += [{"role": "assistant", "content": said}, {"role": "user", "content": hint}]
    print(json.dumps({"episode_id": episode["episode_id"], "reward": reward, "turn_rewards": per_guess}), flush=True)
