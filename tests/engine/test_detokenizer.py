"""IncrementalDetokenizer against the tokenizers' own full decode.

Three tokenizers: SmolLM2's (byte-level BPE, loaded by transformers from the default model's
GGUF), a Llama-style sentencepiece tokenizer trained here in-process (Metaspace, byte
fallback, the decoder that drops the leading space of a decode), and ByT5's slow Python
tokenizer. The reference for a prompt + output is the decode of both minus the decode of
the prompt: what the output adds to the text.
"""

from __future__ import annotations

import functools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, ByT5Tokenizer, PreTrainedTokenizerFast

from aioserve.engine.detokenizer import (
    MAX_PENDING_TOKENS,
    MAX_PROMPT_CONTEXT_TOKENS,
    IncrementalDetokenizer,
)
from aioserve.engine.stop_strings import StopStringMatcher

PROMPT = "Answer in one line:"
TEXTS = {
    "prose": " The quick brown fox jumps over the lazy dog. It was 3:45 p.m., and nobody cared!",
    "emoji": " Party 🎉 family 👨‍👩‍👧‍👦 flags 🇯🇵🇫🇷 thumbs 👍🏽 done 😀",
    "cjk": " 日本語のテキスト、中文文本。한국어 문장입니다.",
    "mixed": " café Ελληνικά русский עברית العربية हिन्दी 🙂 ok",
    "code": "\ndef f(x):\n\tif x:\n        return  x  # two  spaces\n\n    pass\n",
}
# Chunkings of the output: a token per step, uneven multi-token steps, everything at once.
CHUNKINGS = {"one_by_one": [1], "uneven": [2, 1, 3, 1, 5, 2], "all_at_once": [10**6]}

_LLAMA_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Answer in one line: Hello world, hello there, it was nobody.",
    "Party family flags thumbs done, def return pass if spaces.",
    "café and résumé are French words.",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@functools.cache
def _llama_style(decoder: str) -> PreTrainedTokenizerFast:
    """A tiny sentencepiece-style BPE: Metaspace pre-tokenizer, <0xXX> byte-fallback tokens
    for every character outside its small vocabulary (CJK, emoji, newlines), and either
    Llama's decoder (..., Strip) or a Metaspace decoder; both drop a decode's leading space."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    trained.train_from_iterator(_LLAMA_CORPUS, trainer)
    spec = json.loads(trained.to_str())
    spec["model"]["byte_fallback"] = True
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    if decoder == "llama":
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tokenizer.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    else:
        steps = [decoders.ByteFallback(), decoders.Fuse()]
        tokenizer.decoder = decoders.Sequence([decoders.Metaspace(prepend_scheme="first"), *steps])
    tokenizer.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module", params=["llama", "metaspace"])
def llama_style(request):
    return _llama_style(request.param)


@pytest.fixture(scope="module")
def byt5():
    return ByT5Tokenizer()


@pytest.fixture(scope="module", params=["smollm2", "llama", "metaspace", "byt5"])
def any_tokenizer(request):
    if request.param in ("llama", "metaspace"):
        return _llama_style(request.param)
    return request.getfixturevalue(request.param)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def added_text(tokenizer, prompt: list[int], output: list[int], **decode_kwargs) -> str:
    """What the output adds to the decoded text of the prompt."""
    before = tokenizer.decode(prompt, **decode_kwargs)
    after = tokenizer.decode(prompt + output, **decode_kwargs)
    assert after.startswith(before), "the reference needs a decode that only appends"
    return after[len(before) :]


def stream(tokenizer, prompt, output, chunks, **kwargs) -> list[str]:
    """Feed `output` in chunks of the given sizes (the last size repeats); the pieces."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    pieces, start, step = [], 0, 0
    while start < len(output):
        size = chunks[min(step, len(chunks) - 1)]
        pieces.append(detokenizer.add_tokens(output[start : start + size]))
        assert detokenizer.output_text == "".join(pieces)
        start, step = start + size, step + 1
    return pieces


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_to_what_the_output_adds(any_tokenizer, text, chunking):
    prompt = encode(any_tokenizer, PROMPT)
    output = encode(any_tokenizer, TEXTS[text])
    expected = added_text(any_tokenizer, prompt, output, skip_special_tokens=True)
    pieces = stream(any_tokenizer, prompt, output, CHUNKINGS[chunking])
    assert "".join(pieces) == expected
    # Never half a character: every step's text so far is a prefix of the final text.
    emitted = ""
    for piece in pieces:
        emitted += piece
        assert expected.startswith(emitted)
        assert "\ufffd" not in piece


@pytest.mark.parametrize("text", ["emoji", "cjk", "mixed"])
def test_characters_split_over_tokens_are_held_back_until_whole(any_tokenizer, text):
    prompt, output = encode(any_tokenizer, PROMPT), encode(any_tokenizer, TEXTS[text])
    # The case is real: some tokens hold only part of a character's UTF-8 bytes (decoded
    # alone they give U+FFFD, or nothing for ByT5, whose decode drops invalid bytes).
    alone = [any_tokenizer.decode([token]) for token in output]
    assert any(not part or "\ufffd" in part for part in alone)
    pieces = stream(any_tokenizer, prompt, output, [1])
    assert "" in pieces
    assert "".join(pieces) == added_text(any_tokenizer, prompt, output)


def test_byte_level_output_is_its_plain_decode(smollm2):
    prompt = encode(smollm2, PROMPT)
    output = encode(smollm2, TEXTS["emoji"] + TEXTS["cjk"])
    assert "".join(stream(smollm2, prompt, output, [1])) == smollm2.decode(output)


def test_first_output_token_keeps_its_leading_space(llama_style):
    output = encode(llama_style, " Hello world")
    assert llama_style.convert_ids_to_tokens(output[0]).startswith("▁")
    # Decoded alone the output loses its leading space; after a prompt it must keep it.
    assert llama_style.decode(output) == "Hello world"
    prompt = encode(llama_style, PROMPT)
    assert "".join(stream(llama_style, prompt, output, [1])) == " Hello world"
    assert "".join(stream(llama_style, [], output, [1])) == "Hello world"


def test_prompt_context_starts_on_a_character_boundary(llama_style):
    # Byte-fallback decoders turn a whole run of byte tokens into U+FFFD when it starts
    # inside a character; the prompt's last 5 tokens here start inside 語.
    ids = encode(llama_style, "日本語のテキスト")
    prompt, output = ids[:10], ids[10:]
    assert llama_style.decode(prompt) == "日本語"
    assert "\ufffd" in llama_style.decode(prompt[-5:])
    expected = added_text(llama_style, prompt, output)
    assert expected == "のテキスト"
    assert "".join(stream(llama_style, prompt, output, [1])) == expected


def test_prompt_ending_inside_a_character_decodes_the_output_on_its_own(smollm2):
    ids = encode(smollm2, " 😀!")
    cut = next(i for i in range(1, len(ids)) if smollm2.decode(ids[:i]).endswith("\ufffd"))
    prompt, output = encode(smollm2, PROMPT) + ids[:cut], ids[cut:]
    assert "".join(stream(smollm2, prompt, output, [1])) == smollm2.decode(output)


SPECIAL_CASES = {
    "smollm2": (" Sure.<|im_end|><|im_end|> Next<|endoftext|>", ["<|im_end|>", "<|endoftext|>"]),
    "llama": (" Sure.</s><tool><s> Next", ["</s>", "<s>"]),
    "metaspace": (" Sure.</s><tool><s> Next", ["</s>", "<s>"]),
}


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("name", SPECIAL_CASES)
def test_special_tokens_in_the_output(request, name, skip):
    if name == "smollm2":
        tokenizer = request.getfixturevalue(name)
    else:
        tokenizer = _llama_style(name)
    text, specials = SPECIAL_CASES[name]
    prompt, output = encode(tokenizer, PROMPT), encode(tokenizer, text)
    expected = added_text(tokenizer, prompt, output, skip_special_tokens=skip)
    for chunks in CHUNKINGS.values():
        pieces = stream(tokenizer, prompt, output, chunks, skip_special_tokens=skip)
        assert "".join(pieces) == expected
    for special in specials:
        assert (special in expected) is not skip
    assert "Next" in expected


@pytest.mark.parametrize("spaces", [True, False])
@pytest.mark.parametrize("skip", [True, False])
def test_slow_tokenizer_added_tokens(byt5, skip, spaces):
    prompt, output = encode(byt5, "xy"), encode(byt5, "ab<extra_id_1><extra_id_2>cd 日")
    pieces = stream(
        byt5, prompt, output, [1], skip_special_tokens=skip, spaces_between_special_tokens=spaces
    )
    if skip:
        expected = "abcd 日"
    elif spaces:  # vLLM's slow path: added tokens joined to the text around them by a space
        expected = "ab <extra_id_1> <extra_id_2> cd 日"
    else:
        expected = "ab<extra_id_1><extra_id_2>cd 日"
        assert expected == added_text(byt5, prompt, output)
    assert "".join(pieces) == expected


def test_ids_outside_the_vocabulary_decode_to_nothing(any_tokenizer):
    prompt = encode(any_tokenizer, PROMPT)
    output = encode(any_tokenizer, " ok")
    padded = [output[0], len(any_tokenizer) + 7, *output[1:], 10**6]
    assert "".join(stream(any_tokenizer, prompt, padded, [1])) == added_text(
        any_tokenizer, prompt, output
    )


def test_no_tokens_no_text(any_tokenizer):
    detokenizer = IncrementalDetokenizer(any_tokenizer, encode(any_tokenizer, PROMPT))
    assert detokenizer.add_tokens([]) == ""
    assert detokenizer.output_text == ""


def test_invalid_bytes_are_released_after_a_bounded_wait(smollm2):
    # Lone UTF-8 continuation bytes never complete a character: the window may not grow
    # forever waiting for one. They come out as U+FFFD, as in the full decode.
    continuation = smollm2.convert_tokens_to_ids("Ģ")  # byte-level BPE's token for 0x80
    assert smollm2.decode([continuation]) == "\ufffd"
    prompt = encode(smollm2, PROMPT)
    detokenizer = IncrementalDetokenizer(smollm2, prompt)
    invalid = [continuation] * 100
    assert MAX_PENDING_TOKENS < len(invalid)
    for token in invalid:
        detokenizer.add_tokens([token])
    assert detokenizer.output_text.startswith("\ufffd" * MAX_PENDING_TOKENS)
    tail = encode(smollm2, " fine")
    detokenizer.add_tokens(tail)
    assert detokenizer.output_text == smollm2.decode(invalid + tail)


class _RecordingBackend:
    """Wraps a Rust tokenizer and records how many ids each decode is given."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.lengths: list[int] = []

    def decode(self, ids, skip_special_tokens):
        self.lengths.append(len(ids))
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


class _RecordingTokenizer:
    is_fast = True

    def __init__(self, tokenizer) -> None:
        self.backend_tokenizer = _RecordingBackend(tokenizer.backend_tokenizer)


def test_each_step_decodes_a_short_window_not_the_whole_output(smollm2):
    recording = _RecordingTokenizer(smollm2)
    output = encode(smollm2, "".join(TEXTS.values()) * 20)
    prompt = encode(smollm2, PROMPT * 10)
    detokenizer = IncrementalDetokenizer(recording, prompt)
    for token in output:
        detokenizer.add_tokens([token])
    assert detokenizer.output_text == smollm2.decode(output)
    lengths = recording.backend_tokenizer.lengths
    assert len(output) > 1000
    assert max(lengths) <= MAX_PROMPT_CONTEXT_TOKENS + 1
    assert sum(lengths) <= 8 * len(output)


@pytest.fixture(scope="module")
def smollm2_token_pool(smollm2) -> list[int]:
    """Tokens that make decoding hard: partial UTF-8 bytes, special tokens, plain words."""
    backend = smollm2.backend_tokenizer
    partial = [i for i in range(len(smollm2)) if "\ufffd" in backend.decode([i])]
    plain = encode(smollm2, "".join(TEXTS.values()))
    return partial[::7] + plain + smollm2.all_special_ids


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_byte_level_outputs_match_the_full_decode(smollm2, smollm2_token_pool, data):
    # Fewer tokens than MAX_PENDING_TOKENS: under that bound nothing is emitted early.
    assert MAX_PENDING_TOKENS > 24
    output = data.draw(st.lists(st.sampled_from(smollm2_token_pool), max_size=24))
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=8))
    skip = data.draw(st.booleans())
    prompt = encode(smollm2, PROMPT)
    pieces = stream(smollm2, prompt, output, chunks, skip_special_tokens=skip)
    full = smollm2.decode(output, skip_special_tokens=skip)
    # A character still incomplete when the output ends is never emitted.
    pending = 0
    while pending < len(output) and smollm2.decode(
        output[: len(output) - pending], skip_special_tokens=skip
    ).endswith("\ufffd"):
        pending += 1
    expected = smollm2.decode(output[: len(output) - pending], skip_special_tokens=skip)
    assert "".join(pieces) == expected
    assert full.startswith(expected)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_ends_the_text(smollm2, include):
    stop = "\nUser:"
    assert len(encode(smollm2, stop)) > 1
    prompt = encode(smollm2, PROMPT)
    output = encode(smollm2, " The answer is 42 😀.\nUser: and after that?")
    detokenizer = IncrementalDetokenizer(smollm2, prompt)
    matcher = StopStringMatcher([stop], include)
    text, matched = "", None
    for token in output:
        safe, matched = matcher.process(detokenizer.add_tokens([token]))
        text += safe
        if matched is not None:
            break
    assert matched == stop
    assert text == " The answer is 42 😀." + (stop if include else "")


@pytest.fixture(scope="module", params=["smollm2", "llama", "metaspace"])
def fast_tokenizer_and_pool(request):
    """A fast tokenizer and tokens that make streaming hard: partial UTF-8 bytes, tokens that
    decode to nothing, special tokens, an id outside the vocabulary, plain words."""
    if request.param == "smollm2":
        tokenizer = request.getfixturevalue("smollm2")
    else:
        tokenizer = _llama_style(request.param)
    backend = tokenizer.backend_tokenizer
    alone = {i: backend.decode([i]) for i in range(len(tokenizer))}
    partial = [i for i, text in alone.items() if "\ufffd" in text]
    empty = [i for i, text in alone.items() if not text]
    plain = encode(tokenizer, "".join(TEXTS.values()))
    pool = partial[:: max(1, len(partial) // 60)] + empty[:20] + plain + tokenizer.all_special_ids
    return tokenizer, pool + [len(tokenizer) + 3]


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_decode_stream_gives_the_pieces_of_the_python_window(fast_tokenizer_and_pool, data):
    # Fast tokenizers run the window in tokenizers' DecodeStream, handing back to the Python
    # rule where the stream would differ; a tokenizer whose backend is not a
    # `tokenizers.Tokenizer` (here the recording wrapper) only has the Python rule.
    tokenizer, pool = fast_tokenizer_and_pool
    output = data.draw(st.lists(st.sampled_from(pool), max_size=60))
    if data.draw(st.booleans()):  # invalid bytes, released around MAX_PENDING_TOKENS
        partial = [t for t in pool if "\ufffd" in tokenizer.backend_tokenizer.decode([t])]
        run = data.draw(st.integers(MAX_PENDING_TOKENS - 1, MAX_PENDING_TOKENS + 1))
        output = [data.draw(st.sampled_from(partial))] * run + output
    prompt = data.draw(st.sampled_from([encode(tokenizer, PROMPT), [], pool[:7]]))
    chunks = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=6))
    skip = data.draw(st.booleans())
    streamed = stream(tokenizer, prompt, output, chunks, skip_special_tokens=skip)
    python_only = _RecordingTokenizer(tokenizer)
    assert stream(python_only, prompt, output, chunks, skip_special_tokens=skip) == streamed


def test_whole_character_tokens_of_a_byte_level_tokenizer_need_no_decode(smollm2, monkeypatch):
    # Right after a piece, a token that is whole characters by itself adds its own text: it
    # is looked up, not decoded. Only the partial bytes of the emoji need the window.
    import aioserve.engine.detokenizer as detokenizer_module

    calls = {"decodes": 0, "streams": 0}
    real_decoder, real_stream = detokenizer_module._fast_decoder, detokenizer_module.DecodeStream

    def counting_decoder(tokenizer, skip):
        decode = real_decoder(tokenizer, skip)

        def counted(ids):
            calls["decodes"] += 1
            return decode(ids)

        return counted

    def counting_stream(**kwargs):
        calls["streams"] += 1
        return real_stream(**kwargs)

    monkeypatch.setattr(detokenizer_module, "_fast_decoder", counting_decoder)
    monkeypatch.setattr(detokenizer_module, "DecodeStream", counting_stream)
    prompt = encode(smollm2, PROMPT)
    prose = encode(smollm2, TEXTS["prose"])
    emoji = encode(smollm2, " 😀")
    assert len(emoji) > 1 and "\ufffd" in smollm2.decode(emoji[:1])
    detokenizer = IncrementalDetokenizer(smollm2, prompt)
    after_init = dict(calls)
    for token in prose:
        detokenizer.add_tokens([token])
    assert calls == after_init
    for token in emoji + prose:
        detokenizer.add_tokens([token])
    assert calls["streams"] == after_init["streams"] + 1
    assert detokenizer.output_text == smollm2.decode(prose + emoji + prose)


@pytest.mark.parametrize("chunking", ["one_by_one", "uneven"])
@pytest.mark.parametrize("text", ["emoji", "cjk", "mixed", "code"])
def test_a_resumed_detokenizer_goes_on_as_the_one_it_resumes(any_tokenizer, text, chunking):
    """A new detokenizer per chunk, each resumed from the window the one before left
    (what the streamed derender does across calls), gives the same pieces."""
    prompt = encode(any_tokenizer, PROMPT)
    output = encode(any_tokenizer, TEXTS[text])
    expected = stream(any_tokenizer, prompt, output, CHUNKINGS[chunking])
    window, read = IncrementalDetokenizer(any_tokenizer, prompt).window_state
    pieces, start, step = [], 0, 0
    while start < len(output):
        size = CHUNKINGS[chunking][min(step, len(CHUNKINGS[chunking]) - 1)]
        resumed = IncrementalDetokenizer.resumed(any_tokenizer, window, read)
        pieces.append(resumed.add_tokens(output[start : start + size]))
        window, read = resumed.window_state
        start, step = start + size, step + 1
    assert pieces == expected
