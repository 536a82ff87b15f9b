"""The tokenizer wrapper against transformers, on the bundled SmolLM2 tokenizer."""
import json
import shutil

import pytest


from common.engine.model_files import resolve_model
from common.text.chat_template import ChatTemplateOptions
from common.text import tokenizer as tokenizer_module
from common.text.tokenizer import load_eos_token_ids, load_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "Ünïcödé 😀 你好?"}],
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model())


def test_cached_per_directory(tokenizer):
    assert load_tokenizer(resolve_model()) is tokenizer


def test_vocab_and_special_ids(tokenizer):
    assert tokenizer.vocab_size == len(tokenizer.hf_tokenizer) == 49152
    assert tokenizer.model_vocab_size >= tokenizer.vocab_size
    assert tokenizer.eos_token_ids[0] == tokenizer.hf_tokenizer.eos_token_id == 2  # <|im_end|>
    assert {0, 1, 2} <= set(tokenizer.all_special_ids)


@pytest.mark.parametrize("text", ["Hello, world!", "  leading spaces\nand\ttabs", "naïve café 😀 你好",
                                  "<|im_start|>user\nhi<|im_end|>"])
def test_encode_decode_match_transformers(tokenizer, text):
    hf = tokenizer.hf_tokenizer
    ids = tokenizer.encode(text)
    assert ids == hf.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, messages, add_generation_prompt):
    expected = tokenizer.hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True)["input_ids"]
    ids = tokenizer.apply_chat_template(messages, ChatTemplateOptions(add_generation_prompt=add_generation_prompt))
    assert ids == expected
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_content_parts_are_joined(tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tokenizer.apply_chat_template(parts) == tokenizer.apply_chat_template(
        [{"role": "user", "content": "a\nb"}])


@pytest.mark.parametrize("messages,message", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"content": "hi"}], r"messages\[0\] is missing 'role'"),
    ([{"role": "user"}], r"messages\[0\] is missing 'content'"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
     r"messages\[1\]\['role'\] must be one of"),
    ([{"role": "user", "content": None}], r"messages\[0\]\['content'\] must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "only text parts"),
])
def test_malformed_messages_rejected(tokenizer, messages, message):
    with pytest.raises(ValueError, match=message):
        tokenizer.apply_chat_template(messages)


def test_missing_directory_does_not_download(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_tokenizer(tmp_path / "nowhere")


def copy_tokenizer_dir(out_dir, **extra_files):
    source = resolve_model()
    out_dir.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, out_dir / name)
    for name, content in extra_files.items():
        (out_dir / name).write_text(json.dumps(content))
    return out_dir


@pytest.mark.parametrize("generation_eos", [None, [2, 7]], ids=["tokenizer-only", "generation-config-adds"])
def test_eos_ids_without_transformers_equal_the_tokenizers(tmp_path, generation_eos):
    extra = {} if generation_eos is None else {"generation_config.json": {"eos_token_id": generation_eos}}
    model_dir = copy_tokenizer_dir(tmp_path / "model", **extra)
    eos_ids = load_eos_token_ids(model_dir)
    assert str(model_dir.resolve()) not in tokenizer_module._cache  # settled without transformers
    assert eos_ids == load_tokenizer(model_dir).eos_token_ids == (2, *([7] if generation_eos else []))


def test_eos_ids_of_a_directory_with_a_special_tokens_map_come_from_transformers(tmp_path):
    model_dir = copy_tokenizer_dir(tmp_path / "model", **{"special_tokens_map.json": {"eos_token": "<|im_end|>"}})
    assert load_eos_token_ids(model_dir) == (2,)
    assert str(model_dir.resolve()) in tokenizer_module._cache


def test_the_vocabulary_tokenizer_is_the_loaded_one_or_reads_tokenizer_json_alone(tmp_path, tiny_llama_dir):
    from common.text.tokenizer import load_vocabulary_tokenizer
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_vocabulary_tokenizer(tmp_path)
    bundled = resolve_model(None)
    loaded = load_tokenizer(bundled)
    assert load_vocabulary_tokenizer(bundled) is loaded.hf_tokenizer  # no second load
    light = load_vocabulary_tokenizer(tiny_llama_dir)
    assert light.get_vocab() == load_tokenizer(tiny_llama_dir).hf_tokenizer.get_vocab()
