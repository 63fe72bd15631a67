"""The recorded tokens win: a history sent back as text that re-encodes to other tokens (a reply that is not
valid UTF-8 comes back as U+FFFD) continues the recorded tokens, and the reply is trained on as sampled; a
history whose text differs still forks and is counted."""

from __future__ import annotations

from typing import Any

import openai

from sfhpc.data.trajectory import Trajectory
from sfhpc.endpoint import AgentEndpoint, EndpointServer, OpenAIApi
from sfhpc.engine import tokenizer as tk
from tests.endpoint.conftest import RecordingManager, ReplyingEngine

BROKEN = [0xE2, 0x82]  # the first two bytes of a three-byte character: decodes to U+FFFD


def test_the_same_history_in_other_tokens_continues_the_recorded_ones() -> None:
    engine = ReplyingEngine([BROKEN + [tk.END], list(b"7") + [tk.END], list(b"8") + [tk.END], list(b"9") + [tk.END]])
    sink = RecordingManager()
    api = OpenAIApi(AgentEndpoint(engine, sink), model_name="m")
    with EndpointServer(api) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "guess 0-9"}]
        first = client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        tid = first.model_extra["trajectory_id"]
        assert first.choices[0].message.content == "\ufffd"
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "?"}]
        second = client.chat.completions.create(model="m", messages=messages, max_tokens=4,
                                                extra_headers={"X-Trajectory-Id": tid})
        trajectory = sink.trajectory(tid)
        # No fork: the reply stays on the branch as sampled, and is trained on.
        assert trajectory.history_mismatches == 0 and api.health()["history_respelled"] == 1
        assert [list(r) for r, _ in trajectory.replies()] == [BROKEN + [tk.END], list(b"7") + [tk.END]]
        recorded = first.model_extra["prompt_token_ids"] + BROKEN + [tk.END]
        assert second.model_extra["prompt_token_ids"][:len(recorded)] == recorded
        # A history whose text differs (the agent rewrote the reply) forks, as before.
        messages += [{"role": "assistant", "content": "seven"}, {"role": "user", "content": "?"}]
        client.chat.completions.create(model="m", messages=messages, max_tokens=4,
                                       extra_headers={"X-Trajectory-Id": tid})
        assert sink.trajectory(tid).history_mismatches == 1 and api.health()["history_respelled"] == 1


def _sent_back(reply: list[int], said: str, max_tokens: int) -> tuple[Any, Any, Trajectory, OpenAIApi]:
    """A call answered with `reply` (whose text is `said`), then a second call whose history holds that text
    and a user's turn: both responses, the trajectory and the API."""
    sink = RecordingManager()
    api = OpenAIApi(AgentEndpoint(ReplyingEngine([reply, list(b"7") + [tk.END]]), sink), model_name="m")
    with EndpointServer(api) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "write"}]
        first = client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens)
        assert first.choices[0].message.content == said
        messages += [{"role": "assistant", "content": said}, {"role": "user", "content": "?"}]
        second = client.chat.completions.create(model="m", messages=messages, max_tokens=4,
                                                extra_headers={"X-Trajectory-Id": first.model_extra["trajectory_id"]})
    return first, second, sink.trajectory(first.model_extra["trajectory_id"]), api


def test_a_long_reply_respelled_in_hundreds_more_tokens_continues_the_recorded_ones() -> None:
    """The re-encoded reply can be hundreds of tokens longer or shorter than the sampled one (here 300
    broken pairs, 600 tokens, come back as 300 U+FFFD, 900 bytes): where its text ends is found by its
    length, not near the recorded length. Found on the timing scale's agent workload (random letters that
    re-encode into words), where a sixth of the episodes forked after a long reply and 28-33% of the
    generated tokens were never trained on."""
    long_reply = BROKEN * 300 + [tk.END]
    first, second, trajectory, api = _sent_back(long_reply, "\ufffd" * 300, max_tokens=1000)
    assert trajectory.history_mismatches == 0 and api.health()["history_respelled"] == 1
    assert [list(r) for r, _ in trajectory.replies()] == [long_reply, list(b"7") + [tk.END]]
    recorded = first.model_extra["prompt_token_ids"] + long_reply
    assert second.model_extra["prompt_token_ids"][:len(recorded)] == recorded
    # What the history added after the reply (the user's turn) follows it, spelled as sent.
    assert len(second.model_extra["prompt_token_ids"]) < len(recorded) + 20


def test_a_special_token_the_policy_wrote_inside_its_reply_is_not_a_difference() -> None:
    """The reply's text leaves out a role marker written mid-reply; the history the agent sends back is
    still the recorded one, and the marker stays in the trajectory as sampled."""
    inside = [ord("4"), tk.SYSTEM, ord("2"), tk.END]
    _, _, trajectory, api = _sent_back(inside, "42", max_tokens=8)
    assert trajectory.history_mismatches == 0 and api.health()["history_respelled"] == 1
    assert [list(r) for r, _ in trajectory.replies()] == [inside, list(b"7") + [tk.END]]


def test_a_trajectory_continued_after_a_restart_keeps_its_recorded_tokens() -> None:
    """A restart continues a trajectory on a new endpoint, which replays the earlier replies as text: with
    the recorded context adopted (as the rollout rank does from the store), the history spelled in other
    tokens continues the recorded ones; without it, the same turn forks."""
    sink = RecordingManager()
    before = OpenAIApi(AgentEndpoint(ReplyingEngine([BROKEN + [tk.END]] * 2), sink), model_name="m")
    messages = [{"role": "user", "content": "guess 0-9"}]
    with EndpointServer(before) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        ids = [client.chat.completions.create(model="m", messages=messages, max_tokens=4).model_extra["trajectory_id"]
               for _ in range(2)]
    messages += [{"role": "assistant", "content": "\ufffd"}, {"role": "user", "content": "?"}]
    for tid, adopted in zip(ids, (True, False)):
        after = OpenAIApi(AgentEndpoint(ReplyingEngine([list(b"7") + [tk.END]]), sink), model_name="m")
        recorded = sink.trajectory(tid)
        if adopted:
            after.history.adopt(tid, tuple(int(t) for t in recorded.context()),
                                tuple(bool(g) for g in recorded.generated_mask()))
        with EndpointServer(after) as server:
            client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
            client.chat.completions.create(model="m", messages=messages, max_tokens=4,
                                           extra_headers={"X-Trajectory-Id": tid})
        trajectory = sink.trajectory(tid)
        assert trajectory.history_mismatches == (0 if adopted else 1)
        if adopted:  # both replies on the branch as sampled, and trained on
            assert [list(r) for r, _ in trajectory.replies()] == [BROKEN + [tk.END], list(b"7") + [tk.END]]
