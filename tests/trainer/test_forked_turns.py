"""Turns by the boundaries the trajectory manager recorded: a chat template that drops an earlier reply's
reasoning when it renders the history again (as Qwen3's does with ``<think>``) forks the trajectory at every
turn, and the trained branch then holds nothing of the first two replies; the third reply still trains as
the third, with its own reward and against the other members' third replies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from sfhpc.config.recipe import AlgorithmSpec
from sfhpc.endpoint import AgentEndpoint, EndpointServer, OpenAIApi
from sfhpc.engine.hf_tokenizer import HFTokenizer
from sfhpc.model.hf_folder import build_hf_model
from sfhpc.trainer.batch import TrainBatch
from sfhpc.trainer.losses import algorithm_advantages
from tests.endpoint.conftest import RecordingManager, ReplyingEngine

# The brief format's template, with an assistant message's reasoning dropped when the history is rendered.
DROPS_REASONING = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- set content = message['content'].split('</think>')[-1] if message['role'] == 'assistant' "
    "else message['content'] -%}"
    "{{ '<|' + message['role'] + '|>' + content + '<|end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)
REPLIES = ("<think>one</think>4", "<think>two</think>7", "<think>three</think>9")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_hf_model(tmp_path_factory.mktemp("reasoning"), "qwen2", chat_format="brief", layers=1,
                          texts=REPLIES)
    (path / "chat_template.jinja").write_text(DROPS_REASONING)
    return path


def play_three_turns(folder: Path, turn_rewards: list[float]) -> Any:
    """One 3-turn episode through the endpoint (the agent sends each reply back as it received it); returns
    the finished trajectory."""
    tokenizer = HFTokenizer.from_folder(folder)
    engine = ReplyingEngine([tokenizer.encode(text) + [tokenizer.chat_stop_ids[0]] for text in REPLIES])
    sink = RecordingManager()
    with EndpointServer(OpenAIApi(AgentEndpoint(engine, sink), model_name="m", tokenizer=tokenizer)) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=30)
        messages: list[Any] = [{"role": "user", "content": "guess"}]
        headers: dict[str, str] = {}
        for turn in range(3):
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=32, extra_headers=headers)
            assert reply.choices[0].message.content == REPLIES[turn]
            headers = {"X-Trajectory-Id": reply.model_extra["trajectory_id"]}  # type: ignore[index]
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "again"}]
        tid = headers["X-Trajectory-Id"]
        sink.finish_episode(tid, sum(turn_rewards), turn_rewards=turn_rewards)
        return sink.trajectory(tid)


def test_a_forked_three_turn_trajectory_trains_each_reply_with_its_own_turns_reward(folder: Path) -> None:
    tokenizer = HFTokenizer.from_folder(folder)
    won, lost = play_three_turns(folder, [0.0, 0.5, 1.0]), play_three_turns(folder, [0.0, 0.5, 0.0])
    assert won.history_mismatches == 2  # turns 2 and 3 each re-rendered the reply before them
    # Each reply as its agent received it, by its recorded turn.
    assert [tokenizer.decode([int(t) for t in r if int(t) not in tokenizer.chat_stop_ids]) for r, _ in won.replies()] \
        == list(REPLIES)
    turns = won.token_turns()
    trained = won.context()[turns >= 0]
    # The branch keeps only the third reply as generated (the others are its observations, re-rendered)...
    assert set(turns[turns >= 0].tolist()) == {2}
    assert tokenizer.decode([int(t) for t in trained if int(t) not in tokenizer.chat_stop_ids]) == REPLIES[2]

    batch = TrainBatch.from_trajectories([won, lost])
    assert batch.reply_turns is not None and set(batch.reply_turns[batch.generated].tolist()) == {2}
    # ... and it trains with the third turn's reward, against the other member's third reply: the winner's
    # tokens get the positive share of the turn rewards (1.0 against 0.0), the loser's the negative.
    algorithm = AlgorithmSpec(credit="turn", turn_reward_weight=1.0, advantage_eps=1e-6)
    advantages = algorithm_advantages(algorithm, batch.rewards, ("g", "g"), batch.generated, batch.turn_rewards,
                                      batch.reply_turns)
    own = advantages[batch.generated.bool()]
    first, second = advantages[0][batch.generated[0]], advantages[1][batch.generated[1]]
    assert len(own) > 0 and torch.all(first > 0.9) and torch.all(second < -0.9), (first, second)
    # Numbered by runs of generated tokens, the third reply would have been reply 0: reward 0.0 for both rows.
    by_runs = algorithm_advantages(algorithm, batch.rewards, ("g", "g"), batch.generated, batch.turn_rewards)
    assert not torch.allclose(by_runs, advantages)
