"""A request's text is built incrementally: each round decodes only its new tokens (and the previous
round's as context), never the whole output again, and the streamed pieces add up to the full decode."""

from __future__ import annotations

import pytest

from serve_app.engine.request import GenerationParams, Request
from tests.conftest import tiny_tokenizer

TEXT = "The quick brown fox — naïve café 🦊 jumps over the lazy dog. " * 6


class CountingTokenizer:
    """The real tokenizer, recording how many ids each decode call reads."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, []

    def decode(self, ids, **kwargs):
        self.decoded.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("per_round", [1, 3, 5])
def test_streamed_text_equals_the_full_decode_and_each_round_decodes_only_new_tokens(per_round):
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode(TEXT)
    assert len(ids) > 100
    counting = CountingTokenizer(tokenizer)
    req = Request("r", [0], GenerationParams(max_tokens=len(ids), ignore_eos=True), "none", 0)
    streamed = ""
    for at in range(0, len(ids), per_round):
        req.append(ids[at: at + per_round], frozenset(), counting)
        out = req.take_output()
        assert "\ufffd" not in out.new_text  # half a character waits for the rest
        streamed += out.new_text
    assert req.finish_reason == "length"
    assert streamed == req.text == tokenizer.decode(ids, skip_special_tokens=True)
    # A decode reads the last rounds' tokens, however long the output: the old re-decode of the whole
    # output read up to len(ids) = 264. (A window waits while it ends inside a multi-byte character;
    # TEXT has runs of those split over byte tokens: "café 🦊" is 8 tokens here.)
    assert max(counting.decoded) <= 3 * per_round + 12, counting.decoded


def test_a_stop_string_cuts_the_text_where_it_starts():
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode(TEXT)
    req = Request("r", [0], GenerationParams(max_tokens=len(ids), stop=("lazy",)), "none", 0)
    for at in range(0, len(ids), 2):
        req.append(ids[at: at + 2], frozenset(), tokenizer)
        if req.finish_reason:
            break
    assert req.finish_reason == "stop"
    assert req.text == TEXT[: TEXT.index("lazy")]
