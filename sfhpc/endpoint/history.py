"""The recorded tokens win: a history an agent sends back that says what was recorded, spelled with other
tokens, continues the recorded tokens instead of forking.

An agent sends a conversation as text, and the endpoint renders it with the chat template. A reply the
policy wrote is then encoded again from its text, which need not give the tokens the policy sampled: a
BPE tokenizer may spell the same text otherwise, and a reply that is not valid UTF-8 (a byte-level model
writes one sooner or later) decodes to U+FFFD, which encodes to three other bytes. The trajectory would
fork there (`sfhpc.data.manager.TrajectoryManager.observe`) and the reply, left on the old branch, would
never be trained on: not rewarded when it helped, not penalised when it did not. A policy that learns to
write such replies escapes its own training signal; measured on guess-number with sfhpc's byte-level tiny
model, forks grew from 1-10 to 185-376 a step (of 64 trajectories) as the reward fell from 0.38 to 0.13.

So when the new prompt's *text* begins with the recorded context's text as the agent saw it (the history
is the same; only its tokens differ), the prompt is the recorded tokens followed by the new prompt's tokens
after that text. "As the agent saw it": a reply's text leaves out the special tokens the policy wrote
inside it (a role marker mid-reply), so those are left out of the comparison too; they stay in the
recorded tokens.
A history whose text differs (arguments re-written as canonical JSON, reasoning a template drops, an agent
that edited a turn) still forks, and is counted as a mismatch, never silently re-spelled.

The contexts are the ones this endpoint produced (prompt + reply, per trajectory), and those of trajectories
a restart continues here (`adopt`: the recorded tokens, from the store); a trajectory reclaimed from another
rank mid-episode has none, and its next turn is taken as sent.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from sfhpc.engine.tokenizer import ChatTokenizer

WINDOW = 8  # how far around the prefix of the same text's length its exact token boundary is looked for
KEPT = 16384  # contexts kept (trajectories in flight on one rank are far fewer)


class RecordedContexts:
    """The token context after each trajectory's latest reply on this endpoint, and the splice above."""

    def __init__(self, tokenizer: ChatTokenizer, kept: int = KEPT) -> None:
        self.tokenizer = tokenizer
        self.kept = kept
        # trajectory -> (its tokens after the latest reply, which of them the policy generated)
        self._contexts: collections.OrderedDict[str, tuple[tuple[int, ...], tuple[bool, ...]]] = \
            collections.OrderedDict()
        self.respelled = 0  # turns whose history was the same text in other tokens, continued as recorded

    def get(self, trajectory_id: str) -> tuple[int, ...]:
        return self._contexts.get(trajectory_id, ((), ()))[0]

    def replied(self, trajectory_id: str, prompt: tuple[int, ...], reply: tuple[int, ...]) -> None:
        before, generated = self._contexts.get(trajectory_id, ((), ()))
        if prompt[:len(before)] != before:  # a fork: what the new branch holds of earlier replies is unknown here
            generated = ()
        generated = generated + (False,) * (len(prompt) - len(generated)) + (True,) * len(reply)
        self._keep(trajectory_id, prompt + reply, generated)

    def _keep(self, trajectory_id: str, tokens: tuple[int, ...], generated: tuple[bool, ...]) -> None:
        """Hold `trajectory_id`'s context as the newest, dropping the oldest beyond `kept`."""
        self._contexts[trajectory_id] = (tokens, generated)
        self._contexts.move_to_end(trajectory_id)
        while len(self._contexts) > self.kept:
            self._contexts.popitem(last=False)

    def adopt(self, trajectory_id: str, tokens: tuple[int, ...], generated: tuple[bool, ...]) -> None:
        """Take the recorded context of a trajectory that moved here (a restart continues it on this rank):
        its tokens and which of them the policy generated, so that its next turn, whose history repeats
        the earlier replies as text, continues the recorded tokens as a turn of this endpoint's own would."""
        self._keep(trajectory_id, tuple(tokens), tuple(generated))

    def prompt(self, trajectory_id: str, prompt: tuple[int, ...]) -> tuple[int, ...]:
        """The prompt a new turn of `trajectory_id` continues with: `prompt` itself, or the recorded
        context followed by what `prompt` adds, when the two say the same up to the context's end."""
        context, generated = self._contexts.get(trajectory_id, ((), ()))
        if not context or prompt[:len(context)] == context:
            return prompt
        at = self._boundary(self._seen(context, generated), prompt)
        if at is None:
            return prompt
        self.respelled += 1
        return context + prompt[at:]

    def _seen(self, context: Sequence[int], generated: Sequence[bool]) -> list[int]:
        """The context as the agent saw it: without the special tokens the policy wrote inside its replies
        (a reply's text leaves them out; the end-of-turn token that ends a reply stays: templates write it)."""
        tk, stops = self.tokenizer, set(self.tokenizer.chat_stop_ids)
        return [t for t, g in zip(context, generated) if not (g and t not in stops and tk.is_special(t))] \
            + list(context[len(generated):])

    def _boundary(self, seen: Sequence[int], prompt: Sequence[int]) -> int | None:
        """The length of the prompt's prefix whose text is exactly the text of `seen` (None: none is).

        The prefix's length is found by its text's length, not near `seen`'s: a reply re-encoded from its
        text can take hundreds of tokens fewer than were sampled (a thousand single letters that merge
        into words), and the boundary then lies that far before the recorded length."""
        decode = self.tokenizer.decode
        text = decode(seen, skip_special=False)
        if not decode(prompt, skip_special=False).startswith(text):
            return None
        # The shortest prefix whose text is as long: a token adds text (a partial UTF-8 character may count
        # one more or less, so the first exact match is looked for around it).
        low, high = 1, len(prompt)
        while low < high:
            middle = (low + high) // 2
            if len(decode(prompt[:middle], skip_special=False)) >= len(text):
                high = middle
            else:
                low = middle + 1
        return next((k for k in range(max(1, low - WINDOW), min(len(prompt), low + WINDOW) + 1)
                     if decode(prompt[:k], skip_special=False) == text), None)
