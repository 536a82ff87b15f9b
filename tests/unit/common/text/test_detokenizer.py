"""Incremental detokenization with the bundled SmolLM2 tokenizer (byte-level BPE: a
multi-byte character is often split over tokens, the case byte-fallback <0xE2>
tokens create in sentencepiece vocabularies)."""
import pytest

from common.engine.model_files import resolve_model
from common.text.detokenizer import IncrementalDetokenizer
from common.text.tokenizer import load_tokenizer

TEXTS = [
    "Plain ASCII, with  double spaces and a newline\nhere.",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧 in a row",
    "中文测试：你好，世界！日本語のテキスト、한국어 텍스트",
    "Accents: naïve café, Ångström, ½ ≤ ∞, Ελληνικά, кириллица",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model())


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}])


def stream(tokenizer, prompt_ids, ids, chunk=1, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, **kwargs)
    deltas = [detok.update(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return detok, deltas, detok.flush()


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_full_decode_without_broken_chars(tokenizer, prompt_ids, text, chunk):
    ids = tokenizer.encode(text)
    detok, deltas, tail = stream(tokenizer, prompt_ids, ids, chunk)
    assert "".join(deltas) + tail == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.output_text == text and not detok.finished and detok.stop_string is None


def test_split_characters_are_held_until_complete(tokenizer, prompt_ids):
    ids = tokenizer.encode("😀")
    assert len(ids) > 1 and "\ufffd" in tokenizer.decode(ids[:1])  # really split over tokens
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    assert [detok.update([i]) for i in ids] == [""] * (len(ids) - 1) + ["😀"]


def test_incomplete_character_at_the_end_is_flushed_like_decode(tokenizer, prompt_ids):
    ids = tokenizer.encode("ok 😀")[:-1]
    detok, deltas, tail = stream(tokenizer, prompt_ids, ids)
    assert "".join(deltas) == "ok"
    assert "".join(deltas) + tail == tokenizer.decode(ids) and tail.endswith("\ufffd")


def test_first_token_keeps_its_leading_space(tokenizer):
    prompt = tokenizer.encode("Hello")
    ids = tokenizer.encode(" world")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert detok.update(ids) == " world"
    # A prompt ending inside a character leaves no clean context; decoding still works.
    broken_prompt = tokenizer.encode("x😀")[:-1]
    assert "".join(stream(tokenizer, broken_prompt, ids)[1]) == " world"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, prompt_ids, skip):
    ids = tokenizer.encode("Done.") + [tokenizer.eos_token_ids[0]]
    _, deltas, tail = stream(tokenizer, prompt_ids, ids, skip_special_tokens=skip)
    text = "".join(deltas) + tail
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert text == ("Done." if skip else "Done.<|im_end|>")


def pieces(tokenizer, ids):
    return [tokenizer.decode(ids[:i + 1])[len(tokenizer.decode(ids[:i])):] for i in range(len(ids))]


def test_stop_string_spanning_tokens(tokenizer, prompt_ids):
    text = "The answer is forty-two. Anything else?"
    ids = tokenizer.encode(text)
    stop = "forty-two"
    assert not any(stop in piece for piece in pieces(tokenizer, ids))  # spans tokens
    detok, deltas, tail = stream(tokenizer, prompt_ids, ids, stop=[stop])
    assert "".join(deltas) + tail == "The answer is " == detok.output_text
    assert detok.finished and detok.stop_string == stop and tail == ""
    assert detok.update(tokenizer.encode(" more")) == ""  # nothing after the stop


def test_include_stop_str_in_output(tokenizer, prompt_ids):
    ids = tokenizer.encode("The answer is forty-two. Anything else?")
    detok, deltas, tail = stream(tokenizer, prompt_ids, ids, stop=["two."],
                                 include_stop_str_in_output=True)
    assert "".join(deltas) == "The answer is forty-two." == detok.output_text
    assert detok.stop_string == "two." and tail == ""


def test_stop_string_inside_one_token_and_at_start(tokenizer, prompt_ids):
    detok, deltas, _ = stream(tokenizer, prompt_ids, tokenizer.encode("Hello there"), stop=["ll"])
    assert "".join(deltas) == "He" and detok.finished
    detok, deltas, _ = stream(tokenizer, prompt_ids, tokenizer.encode("Hello there"), stop=["Hel"])
    assert "".join(deltas) == "" and detok.finished


def test_earliest_stop_string_wins(tokenizer, prompt_ids):
    ids = tokenizer.encode("one two three")
    detok, deltas, _ = stream(tokenizer, prompt_ids, ids, chunk=len(ids), stop=["three", "two"])
    assert deltas == ["one "] and detok.stop_string == "two"


def test_possible_stop_prefix_is_held_then_released(tokenizer, prompt_ids):
    ids = tokenizer.encode("we STOP now")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["STOPPED", "xyz"])
    deltas, held = [], []
    for token_id in ids:
        deltas.append(detok.update([token_id]))
        held.append(detok.output_text[len("".join(deltas)):])
    assert max(len(h) for h in held) <= len("STOPPED") - 1
    assert "STOP" in held  # "STOP" could still become "STOPPED"
    assert held[-1] == ""  # " now" proved it was not a stop string
    assert "".join(deltas) == "we STOP now" and detok.flush() == "" and not detok.finished


def test_held_prefix_is_flushed_at_the_end(tokenizer, prompt_ids):
    ids = tokenizer.encode("we STOP")
    detok, deltas, tail = stream(tokenizer, prompt_ids, ids, stop=["STOPPED"])
    assert "".join(deltas) == "we " and tail == "STOP"
    assert detok.stop_string is None and detok.output_text == "we STOP"


def test_no_hold_back_with_include_stop_str(tokenizer, prompt_ids):
    ids = tokenizer.encode("we STOP now")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["STOPPED"], include_stop_str_in_output=True)
    deltas = [detok.update([token_id]) for token_id in ids]
    assert "".join(deltas) == "we STOP now"
    assert all(d == p for d, p in zip(deltas, pieces(tokenizer, ids)))  # sent as soon as decoded


class _ByteFallbackTokenizer:
    """A Llama/sentencepiece-style vocabulary: characters missing from it are spelled
    as <0xNN> byte tokens, so one character spans several tokens."""

    def __init__(self):
        from tokenizers import Tokenizer, decoders, models
        vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)},
                 "▁hello": 257, "▁": 258, "wor": 259, "ld": 260}
        self.backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
        self.backend.decoder = decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])

    def ids(self, text_after_hello: str) -> list[int]:
        return [257, 258] + [1 + b for b in text_after_hello.encode()] + [258, 259, 260]


def test_byte_fallback_tokens():
    tokenizer = _ByteFallbackTokenizer()
    ids = tokenizer.ids("é😀")
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.update([i]) for i in ids]
    assert deltas == ["hello", " ", "", "é", "", "", "", "😀", " ", "wor", "ld"]
    assert "".join(deltas) + detok.flush() == tokenizer.backend.decode(ids) == "hello é😀 world"
    # In context, the first token keeps the space the decoder strips at a text's start.
    assert IncrementalDetokenizer(tokenizer, [257]).update(ids[:1]) == " hello"
    # Cut inside the emoji: flush returns its bytes as U+FFFD, as decode does (one per byte).
    cut = ids[:6]
    detok = IncrementalDetokenizer(tokenizer, [257])
    text = "".join(detok.update([i]) for i in cut)
    assert text == " hello é"
    assert detok.flush() == tokenizer.backend.decode(cut)[len("hello é"):] == "\ufffd" * 3
