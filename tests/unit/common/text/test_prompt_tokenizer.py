"""The torch-free prompt tokenizer (gateway, offline LLM) gives the same ids as common.text.tokenizer (transformers)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from common.engine.model_files import resolve_model
from common.text.chat_template import ChatTemplateOptions
from common.text.tokenizer import load_tokenizer
from common.text.prompt_tokenizer import PromptTokenizer, load_prompt_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "Ünïcödé 😀 你好?"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]}],
]


@pytest.fixture(scope="module")
def pair():
    model_dir = resolve_model()
    return PromptTokenizer(model_dir), load_tokenizer(model_dir)


def test_vocab_and_eos_match(pair):
    ours, reference = pair
    assert (ours.vocab_size, ours.model_vocab_size, ours.eos_token_ids) == (
        reference.vocab_size, reference.model_vocab_size, reference.eos_token_ids)


@pytest.mark.parametrize("text", ["Hello, world!", "  spaces\nand\ttabs", "naïve café 😀 你好", "<|im_start|>x"])
def test_encode_matches(pair, text):
    ours, reference = pair
    assert ours.encode(text) == reference.encode(text)


OPTIONS = [ChatTemplateOptions(), ChatTemplateOptions(add_generation_prompt=False),
           ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True),
           ChatTemplateOptions(chat_template_kwargs={"enable_thinking": False, "date": "2026-12-04"}),
           ChatTemplateOptions(chat_template="{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] "
                                             "{{ m['content'] }}\n{% endfor %}"
                                             "{% if add_generation_prompt %}[assistant]{% endif %}")]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("options", OPTIONS, ids=["default", "no_generation_prompt", "continue", "kwargs",
                                                  "request_template"])
def test_chat_template_matches(pair, messages, options):
    ours, reference = pair
    assert ours.apply_chat_template(messages, options) == reference.apply_chat_template(messages, options)
    assert (ours.apply_chat_template(messages, options, add_special_tokens=True)
            == reference.apply_chat_template(messages, options, add_special_tokens=True))


@pytest.mark.parametrize("messages, error", [
    ([], "non-empty list"),
    ([{"role": "user"}], "missing 'content'"),
    ([{"role": "robot", "content": "x"}], "role"),
    ([{"role": "user", "content": 5}], "must be a string"),
])
def test_bad_messages_raise_value_error(pair, messages, error):
    with pytest.raises(ValueError, match=error):
        pair[0].apply_chat_template(messages)


def test_loading_the_served_model_imports_no_torch(tmp_path):
    code = ("import sys; from gateway.validation import load_served_model; m = load_served_model(None); "
            "m.tokenizer.apply_chat_template([{'role': 'user', 'content': 'hi'}]); "
            "assert 'torch' not in sys.modules, 'torch was imported'; print(type(m.tokenizer).__name__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "PromptTokenizer"


def test_directory_without_tokenizer_json_falls_back_to_transformers(tmp_path):
    with pytest.raises(ValueError):  # common.text.tokenizer's error for a missing directory
        load_prompt_tokenizer(tmp_path / "missing")
