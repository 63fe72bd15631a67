"""Partial rollout in the real loop (real torch training, real MPI, the HDF5 store; the test engine).

Weight updates must land while the engine generates: the generations are paused, the new weights loaded,
and they continue from their prefix on the new version. How fast a machine finishes its replies must not
decide whether that happens, so the test engine holds every reply that starts under a new version at its
20th token until the next weight update cuts it there (``cut_after_tokens``; the first version's replies and
continuations run freely, so batches complete). The stored trajectories must show it: replies whose tokens
carry two versions, split into segments at the cut and joined again on one branch; the text the agent was
given equals prefix + continuation (the task's reward function records every reply it judges); no
generated token is left off the branch (none discarded). vLLM's own pause and continuation are
`tests/engine/test_vllm_engine.py`'s, its cuts in a real loop `test_seamless_vllm.py`'s and the Slurm
preemption test's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sfhpc.data.store import open_store
from sfhpc.engine.tokenizer import load_tokenizer
from tests.rl.recorded_replies import run_recording_replies, task_and_roles

pytestmark = [pytest.mark.mpi]

REPLY_TOKENS = 48
CUT_AT = 20
RECIPE = f"""\
name: partial
seed: 4
engine: {{name: test, writes_to_budget: true, cut_after_tokens: {CUT_AT}}}
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
            if generated[0].versions[0] >= 1:  # held at the cut token (version 0's are cut wherever they are)
                assert len(generated[0]) == CUT_AT
            # each cut segment ends where the next one starts: one reply, prefix + continuation
            assert all(len(set(s.versions.tolist())) == 1 for s in generated)
        text = tokenizer.decode([int(x) for x in reply if int(x) not in stops])
        assert text in judged  # what the agent was handed is exactly the stored prefix + continuation
    assert len(trajectories) >= 4 * 4 * 4
    # The groups handed out under versions 1 and 2 (4 of 4 replies each) are cut by the next update and
    # trained at steps 3 and 4.
    assert cut_across_versions >= 2 * 4 * 4, f"only {cut_across_versions} replies were cut by a weight update"
