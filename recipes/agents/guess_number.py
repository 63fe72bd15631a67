"""An agent program for the guess-number recipe: plain `openai`, nothing of sfhpc.

sfhpc starts it once per episode with OPENAI_BASE_URL (this episode's URL on the rollout rank's endpoint)
and OPENAI_API_KEY (the run's token) set, and the episode's input, one JSON object, on stdin. Every call it
makes is recorded in the episode's trajectory. The program plays the environment itself: it knows the
secret digit (the problem's data), answers each guess with "higher" or "lower" and asks again. It prints
its reward on its last line; without that line, the task's verifier would judge its final reply.
"""

import json
import sys

import openai

episode = json.load(sys.stdin)
secret = int(episode["problem"]["data"])
client = openai.OpenAI()  # base URL and key from the environment
messages = list(episode["messages"])
for turn in range(1, 9):
    reply = client.chat.completions.create(model=episode["model"], messages=messages,
                                           max_tokens=episode["max_tokens"])
    guess = (reply.choices[0].message.content or "").strip()
    if guess == str(secret):
        print(json.dumps({"reward": 1.0 - 0.1 * (turn - 1)}))
        break
    hint = "?" if not (guess.isascii() and guess.isdigit()) else "higher" if int(guess) < secret else "lower"
    messages += [{"role": "assistant", "content": guess}, {"role": "user", "content": hint}]
else:
    print(json.dumps({"reward": 0.0}))
