"""Partial rollout in the real loop (real vLLM, real torch training, real MPI, the HDF5 store).

An untrained policy writes long replies (it rarely draws its end-of-turn token, so replies run to their
96-token budget), so every weight update lands while the engine generates: those generations are paused,
the new weights loaded, and they continue from their prefix on the new version. The stored trajectories
must show it: replies whose tokens carry two versions, split into segments at the cut and joined again on
one branch; the text the agent was given equals prefix + continuation (the task's reward function records
every reply it judges); no generated token is left off the branch (none discarded).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sfhpc.data.store import open_store
from sfhpc.engine.tokenizer import load_tokenizer
from tests.rl.recorded_replies import run_recording_replies, task_and_roles

pytestmark = [pytest.mark.vllm, pytest.mark.mpi]

REPLY_TOKENS = 96
RECIPE = f"""\
name: partial
seed: 4
algorithm: {{group_size: 4}}
pipeline: {{mode: async, max_staleness: 1}}
budgets: {{steps: 4, prompts_per_step: 4, max_new_tokens: {REPLY_TOKENS}}}
""" + task_and_roles(REPLY_TOKENS)


def test_weight_updates_cut_generations_that_continue_on_the_new_version(tmp_path: Path) -> None:
    run_dir, judged = run_recording_replies(tmp_path, RECIPE)

    with open_store(run_dir / "trajectories.h5") as store:
        trajectories = [t for t in store.trajectories() if t.status in ("consumed", "finished")]
    tokenizer = load_tokenizer(run_dir / "model")  # the model the run built, with its tokenizer
    stops = set(tokenizer.chat_stop_ids)
    cut_across_versions = 0
    for t in trajectories:
        (reply, cut), = t.replies()  # single-turn: one reply, finished
        assert not cut
        generated = [s for s in t.segments if s.generated]
        # Nothing generated is off the branch: every generated token of every segment is in the reply.
        assert sum(len(s) for s in generated) == len(reply) == t.num_generated
        versions = t.token_versions()[t.generated_mask()]
        assert np.all(np.diff(versions) >= 0)  # a continuation is never older than its prefix
        if len(set(versions.tolist())) > 1:
            cut_across_versions += 1
            assert len(generated) >= 2 and generated[0].finish_reason == "abort"
            # each cut segment ends where the next one starts: one reply, prefix + continuation
            assert all(len(set(s.versions.tolist())) == 1 for s in generated)
        text = tokenizer.decode([int(x) for x in reply if int(x) not in stops])
        assert text in judged  # what the agent was handed is exactly the stored prefix + continuation
    assert len(trajectories) >= 4 * 4 * 4
    assert cut_across_versions >= 4, f"only {cut_across_versions} replies were cut by a weight update"
