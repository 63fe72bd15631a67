"""An agent program as a user would write it: the `openai` package and the environment, nothing of sfhpc.

It plays guess-the-digit by itself: it asks the model, reads the guess, compares it with the secret in its
episode input and, while the guess is wrong, tells the model "higher" or "lower" and asks again (at most
--turns times). The task's verifier then judges its final reply, unless --report says how to give a reward.

Faults for tests, by the problem's key (the secret digit): --crash-on KEYS raises after the first reply,
--hang-on KEYS sleeps forever (with a child process in its group) after the first reply. With --fault-dir,
the first episode of a run that claims DIR/crash crashes and the next of another problem that claims
DIR/hang hangs (a file made with O_EXCL is claimed once, whichever programs run at the same time). Another
problem, so another GRPO group: the rest of the crashed episode's group is dropped with it, a hang there
would never time out.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import openai

parser = argparse.ArgumentParser()
parser.add_argument("--turns", type=int, default=4)
parser.add_argument("--report", choices=["verifier", "stdout", "post"], default="verifier")
parser.add_argument("--crash-on", default="")
parser.add_argument("--hang-on", default="")
parser.add_argument("--pid-file")
parser.add_argument("--fault-dir")
args = parser.parse_args()


def claim(name: str) -> bool:
    try:
        os.close(os.open(os.path.join(args.fault_dir, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def crashed_key() -> str:
    """The problem key of the episode that claimed the crash (it writes it just after its claim)."""
    path = os.path.join(args.fault_dir, "crash-key")
    for _ in range(200):
        if os.path.exists(path):
            with open(path) as f:
                return f.read()
        time.sleep(0.01)
    return ""


episode = json.load(sys.stdin)
public = json.loads(os.environ["SFHPC_EPISODE"])  # the same input without the problem's data (its answer)
assert public == {**episode, "problem": {"key": episode["problem"]["key"]}}, public
fault = None
if args.fault_dir:
    key = str(episode["problem"]["key"])
    if claim("crash"):
        fault = "crash"
        with open(os.path.join(args.fault_dir, "crash-key.part"), "w") as f:
            f.write(key)
        os.replace(os.path.join(args.fault_dir, "crash-key.part"), os.path.join(args.fault_dir, "crash-key"))
    elif crashed_key() != key and claim("hang"):
        fault = "hang"
secret = str(episode["problem"]["data"])
client = openai.OpenAI(max_retries=0, timeout=120)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
messages = list(episode["messages"])
found = False
for turn in range(args.turns):
    reply = client.chat.completions.create(model=episode["model"], messages=messages,
                                           max_tokens=episode["max_tokens"], temperature=1.0)
    guess = (reply.choices[0].message.content or "").strip()
    print(f"turn {turn + 1}: guessed {guess!r}", file=sys.stderr)
    if fault == "crash" or episode["problem"]["key"] in args.crash_on.split(","):
        raise RuntimeError(f"agent crashed on purpose after guessing {guess!r}")
    if fault == "hang" or episode["problem"]["key"] in args.hang_on.split(","):
        # Pids as the node sees them (inside a PID namespace the program is 1): /proc is the node's. The
        # program's first, then its child's.
        note = args.pid_file or os.devnull
        if args.pid_file:
            with open(args.pid_file, "a") as f:
                f.write(os.readlink("/proc/self") + "\n")
        subprocess.Popen([sys.executable, "-c", "import os, sys, time; print(os.readlink('/proc/self'), "
                          "file=open(sys.argv[1], 'a'), flush=True); time.sleep(600)", note])
        while args.pid_file and len(Path(args.pid_file).read_text().split()) < 2:
            time.sleep(0.01)
        time.sleep(600)
    if guess == secret:
        found = True
        break
    hint = "higher" if guess.isdigit() and int(guess) < int(secret) else "lower" if guess.isdigit() else "?"
    messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                 {"role": "user", "content": hint}]

reward = 1.0 if found else 0.0
if args.report == "stdout":
    print("some chatter that is not a reward")
    print(json.dumps({"reward": reward + 10}))  # offset: tells the program's reward from the verifier's
elif args.report == "post":
    import httpx

    base = os.environ["OPENAI_BASE_URL"].removesuffix("/v1")
    httpx.post(f"{base}/reward", json={"reward": reward + 20},
               headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}).raise_for_status()
