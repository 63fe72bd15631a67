"""Stop strings are matched incrementally: over a reply of n tokens the matcher decodes and searches O(n)
tokens and characters (it used to decode the whole reply after every token: O(n^2)), and finds a stop string
however the tokens that spell it arrive; the Hugging Face stream decoder it reads through is linear too, and
gives the text the whole decode gives."""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from sfhpc.endpoint.protocol import StopMatcher
from sfhpc.engine.hf_tokenizer import HFStreamDecoder, HFTokenizer
from sfhpc.engine.tokenizer import ByteTokenizer
from sfhpc.model.hf_folder import build_hf_model


class CountingTokenizer:
    """A tokenizer that counts the token ids it decodes."""

    def __init__(self, inner: HFTokenizer) -> None:
        self.inner = inner
        self.decoded = 0

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        ids = list(ids)
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special=skip_special)

    def stream_decoder(self, *, skip_special: bool = True) -> HFStreamDecoder:
        return HFStreamDecoder(self, skip_special=skip_special)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    folder: Path = build_hf_model(tmp_path_factory.mktemp("stop") / "model", "qwen2", layers=1)
    return HFTokenizer.from_folder(folder)


def test_matching_a_long_reply_decodes_and_searches_each_token_a_bounded_number_of_times(hf: HFTokenizer) -> None:
    rng = random.Random(0)
    letters = [t for c in "abcdefghijklmnopqrstuvwxyz " for t in hf.encode(c)]
    tokens = [rng.choice(letters) for _ in range(8000)]
    counting = CountingTokenizer(hf)
    matcher = StopMatcher(["never met", "zzzzzz"], counting)  # type: ignore[arg-type]
    assert not any(matcher([t]) for t in tokens)
    # Linear: a few decodes and searches per token, where the old matcher decoded 8000 * 8001 / 2 = 32 million.
    assert counting.decoded <= 4 * len(tokens)
    assert matcher.searched <= (1 + len("never met")) * len(tokens)


@pytest.mark.parametrize("chunk", [1, 3, 50])
def test_a_stop_string_across_tokens_and_chunks_is_found_where_it_completes(hf: HFTokenizer, chunk: int) -> None:
    for tokenizer in (hf, ByteTokenizer()):
        text = "the answer is 42. and then more words"
        ids = tokenizer.encode(text)
        matcher = StopMatcher(["zz", "42. and"], tokenizer)
        fed, met_at = [], None
        for i in range(0, len(ids), chunk):
            fed += ids[i:i + chunk]
            if matcher(ids[i:i + chunk]):
                met_at = len(fed)
                break
        assert met_at is not None
        # Met at the first chunk whose text holds the stop string, as the whole decode would say.
        assert "42. and" in tokenizer.decode(fed) and "42. and" not in tokenizer.decode(fed[:max(0, met_at - chunk)])


def test_the_stream_decoder_is_linear_and_gives_the_whole_decode(hf: HFTokenizer) -> None:
    rng = random.Random(1)
    counting = CountingTokenizer(hf)
    for _ in range(200):  # any ids, partial characters and special tokens included
        ids = [rng.randrange(hf.vocab_size) for _ in range(rng.randrange(1, 60))]
        ids = [t for t in ids if hf.token_bytes(t) or hf.is_special(t)]
        for skip in (True, False):
            decoder = counting.stream_decoder(skip_special=skip)
            streamed = "".join(decoder.feed([t]) for t in ids) + decoder.flush()
            assert streamed == hf.decode(ids, skip_special=skip)
    text = "Hal had 42 apples, then found 555 more; that's plenty! " * 100
    ids = hf.encode(text)
    counting.decoded = 0
    decoder = counting.stream_decoder()
    assert "".join(decoder.feed([t]) for t in ids) + decoder.flush() == hf.decode(ids)
    assert counting.decoded <= 6 * len(ids)
