"""Per-episode URLs: an OpenAI client that sends no trajectory id still records one trajectory per episode."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from sfhpc.endpoint import AgentEndpoint, EndpointServer, OpenAIApi
from sfhpc.endpoint.errors import NotFound
from sfhpc.engine import tokenizer as tk
from sfhpc.engine.scripted import ScriptedEngine
from tests.endpoint.conftest import MODEL, RecordingManager

TOK = tk.ByteTokenizer()


def episode_client(server: EndpointServer, episode_id: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.episode_url(episode_id), api_key="unused", max_retries=0, timeout=30)


def test_calls_on_an_episode_url_grow_its_one_trajectory(server: EndpointServer, sink: RecordingManager) -> None:
    heard: list[str] = []
    episode = server.api.episodes.open(task="guess-number", group="g-7", on_trajectory=heard.append)
    client = episode_client(server, episode.id)
    messages = [{"role": "user", "content": "guess 0-9"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, seed=1)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "higher"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, seed=2)
    # No header, no user field: the URL alone put both calls on one trajectory.
    assert second.trajectory_id == first.trajectory_id == heard[0] == episode.seat().trajectory_id
    record = sink.trajectory(first.trajectory_id)
    assert (record.task, record.group) == ("guess-number", "g-7")
    assert [s.kind for s in record.segments] == ["prompt", "generated", "observation", "generated"]
    assert sink.context(first.trajectory_id) == second.prompt_token_ids + second.choices[0].token_ids
    assert len(sink.ids()) == 1
    assert episode.seat().calls == 2 and episode.seat().last_reply == second.choices[0].message.content
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_a_session_id_of_the_clients_own_is_adopted(server: EndpointServer, sink: RecordingManager) -> None:
    episode = server.api.episodes.open(task="t", group="g")
    client = episode_client(server, episode.id)
    first = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3, user="session-42")
    assert first.trajectory_id == episode.seat().trajectory_id == "session-42"
    assert sink.trajectory("session-42").group == "g"
    # Later calls may repeat the id or leave it out; another id is refused with one line.
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3, extra_headers={"X-Trajectory-Id": "session-42"})
    plain = client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    assert again.trajectory_id == plain.trajectory_id == "session-42"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       user="session-43")
    assert "records trajectory 'session-42'" in refused.value.body["message"]
    assert sink.ids() == ["session-42"]


def test_an_id_the_run_already_holds_is_a_conflict(server: EndpointServer, sink: RecordingManager) -> None:
    taken = sink.start([1, 2], task="t")
    episode = server.api.episodes.open(task="t", group="g")
    with pytest.raises(openai.ConflictError) as clash:
        episode_client(server, episode.id).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, user=taken)
    assert "already in use" in clash.value.body["message"]
    assert episode.seat().trajectory_id is None and sink.ids() == [taken]


def test_calls_that_arrive_together_start_one_trajectory(server: EndpointServer, sink: RecordingManager) -> None:
    episode = server.api.episodes.open(task="t", group="g")
    client = episode_client(server, episode.id)

    def call(i: int) -> str:
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"q{i}"}],
                                               max_tokens=4, stream=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(call, range(4)))
    assert sink.ids() == [episode.seat().trajectory_id]
    assert sink.calls[episode.seat().trajectory_id].count("start") == 1
    assert sink.calls[episode.seat().trajectory_id].count("observe") == 3  # different prompts: three forks
    assert episode.seat().calls == 4 and episode.seat().last_reply in texts


def test_reward_route_and_a_closed_episode(server: EndpointServer) -> None:
    refusing = server.api.episodes.open(task="t", group="g")  # the default: rewards come from elsewhere
    refused = httpx.post(f"{server.episode_url(refusing.id).removesuffix('/v1')}/reward", json={"reward": 1.0})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "reward_not_taken"
    assert refusing.seat().reward is None and server.api.episodes.rewards_refused == 1
    assert httpx.get(f"{server.url.removesuffix('/v1')}/health").json()["rewards_refused"] == 1
    episode = server.api.episodes.open(task="t", group="g", takes_posted_reward=True)
    base = server.episode_url(episode.id).removesuffix("/v1")
    assert httpx.post(f"{base}/reward", json={"reward": 0.5}).json() == {"episode": episode.id, "reward": 0.5}
    assert episode.seat().reward == 0.5
    bad = httpx.post(f"{base}/reward", json={"reward": "high"})
    assert bad.status_code == 400 and "finite number" in bad.json()["error"]["message"]
    assert httpx.post(f"{base}/reward", content=b"{").status_code == 400
    server.api.episodes.close(episode.id)
    gone = httpx.post(f"{base}/v1/chat/completions",
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "episode_not_found"
    assert httpx.post(f"{base}/reward", json={"reward": 1}).status_code == 404
    assert httpx.get(f"{base}/v1/models").status_code == 404


def test_advertised_host_names_the_node_when_bound_to_all_addresses(engine, sink) -> None:  # type: ignore[no-untyped-def]
    import socket

    from sfhpc.endpoint import AgentEndpoint, OpenAIApi

    api = OpenAIApi(AgentEndpoint(engine, sink), model_name=MODEL, token="secret")
    wide = EndpointServer(api, host="0.0.0.0")
    assert wide.episode_url("e1") == f"http://{socket.gethostname()}:0/episodes/e1/v1"
    named = EndpointServer(api, host="0.0.0.0", advertise_host="node7.cluster")
    assert named.url == "http://node7.cluster:0/v1"


def test_the_in_process_client_speaks_for_an_episode_too(server: EndpointServer, sink: RecordingManager) -> None:
    from sfhpc.endpoint import LocalClient

    episode = server.api.episodes.open(task="t", group="g")
    local = LocalClient(server.api, server.loop)
    first = local.chat(episode=episode.id, model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=3)
    # ... and an HTTP call on the episode's URL continues the same trajectory
    second = episode_client(server, episode.id).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a"}, {"role": "assistant",
                                                                  "content": first["choices"][0]["message"]["content"]},
                               {"role": "user", "content": "b"}], max_tokens=3)
    assert first["trajectory_id"] == second.trajectory_id == episode.seat().trajectory_id
    assert [s.kind for s in sink.trajectory(episode.seat().trajectory_id).segments] == ["prompt", "generated",
                                                                                 "observation", "generated"]
    server.api.episodes.close(episode.id)
    with pytest.raises(NotFound):
        local.chat(episode=episode.id, model=MODEL, messages=[{"role": "user", "content": "a"}])


def test_n_choices_are_trajectories_of_their_own_and_a_later_call_continues_the_one_its_history_holds() -> None:
    """``n > 1`` on an episode's URL: each choice is a trajectory of the episode (one episode to its group),
    and the next call, whose history holds the second choice, continues that one."""
    from sfhpc.data.trajectory import episode_of
    from sfhpc.endpoint import AgentEndpoint, OpenAIApi
    from tests.endpoint.conftest import ReplyingEngine

    replies = ["red", "blue", "green", "yes"]
    engine = ReplyingEngine([list(r.encode()) + [tk.END] for r in replies])
    sink = RecordingManager()
    api = OpenAIApi(AgentEndpoint(engine, sink), model_name="m", max_n=3)
    with EndpointServer(api) as server:
        episode = api.episodes.open(task="t", group="g")
        client = openai.OpenAI(base_url=server.episode_url(episode.id), api_key="unused", max_retries=0)
        ask = [{"role": "user", "content": "a colour?"}]
        first = client.chat.completions.create(model="m", messages=ask, n=3, max_tokens=8)
        texts = [c.message.content for c in first.choices]
        ids = [c.model_extra["trajectory_id"] for c in first.choices]
        assert sorted(texts) == ["blue", "green", "red"] and len(set(ids)) == 3
        assert first.usage.completion_tokens == sum(len(t) + 1 for t in texts)
        assert {sink.trajectory(t).group for t in ids} == {"g"}
        assert len({episode_of(t, sink.trajectory(t).metadata_json) for t in ids}) == 1  # one episode
        picked = texts.index("blue")
        follow = ask + [{"role": "assistant", "content": "blue"}, {"role": "user", "content": "sure?"}]
        second = client.chat.completions.create(model="m", messages=follow, max_tokens=8)
        assert second.model_extra["trajectory_id"] == ids[picked]
        assert sink.calls[ids[picked]][-2:] == ["observe", "add_generated:stop"]
        too_many = httpx.post(f"{server.episode_url(episode.id)}/chat/completions",
                              json={"model": "m", "messages": ask, "n": 4})
        streamed = httpx.post(f"{server.episode_url(episode.id)}/chat/completions",
                              json={"model": "m", "messages": ask, "n": 2, "stream": True})
        assert [(r.status_code, r.json()["error"]["param"]) for r in (too_many, streamed)] == [(400, "n"), (400, "n")]


def test_an_episode_key_opens_its_own_episode_alone(engine: ScriptedEngine, sink: RecordingManager) -> None:
    api = OpenAIApi(AgentEndpoint(engine, sink), model_name=MODEL)
    with EndpointServer(api, token="run-token") as server:
        mine, other = server.api.episodes.open(task="t", group="g"), server.api.episodes.open(task="t", group="h")
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

        def call(url: str, key: str) -> httpx.Response:
            return httpx.post(f"{url}/chat/completions", json=chat, headers={"Authorization": f"Bearer {key}"},
                              timeout=30)

        assert call(server.episode_url(mine.id), mine.key).status_code == 200
        # Its key on another episode's URL, or on the run's own routes: 403, nothing generated there.
        assert call(server.episode_url(other.id), mine.key).status_code == 403
        assert call(server.url, mine.key).status_code == 403
        assert other.seat().trajectory_id is None and len(sink.ids()) == 1
        # The run's token opens every route; a key of no episode opens none.
        assert call(server.episode_url(other.id), "run-token").status_code == 200
        assert call(server.episode_url(other.id), "guessed").status_code == 401
        server.api.episodes.close(mine.id)
        assert call(server.episode_url(mine.id), mine.key).status_code == 401  # a closed episode's key is void
