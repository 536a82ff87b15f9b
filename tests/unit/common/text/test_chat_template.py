"""Chat template options: what each does to the rendered prompt, and what is refused."""
from __future__ import annotations

import shutil

import pytest

from common.engine.model_files import resolve_model
from common.text.chat_template import MAX_CHAT_TEMPLATE_KWARGS, ChatTemplateOptions
from common.text.prompt_tokenizer import PromptTokenizer

CHAT = [{"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"}]


@pytest.fixture(scope="module")
def tokenizer():
    return PromptTokenizer(resolve_model())


def with_template(tmp_path, tokenizer, template: str) -> PromptTokenizer:
    """The bundled model's tokenizer with `template` as its chat template."""
    model_dir = tmp_path / "model"
    shutil.copytree(tokenizer.model_dir, model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    (model_dir / "chat_template.jinja").write_text(template)
    return PromptTokenizer(model_dir)


def test_default_ends_with_the_assistant_header(tokenizer):
    text = tokenizer.render_chat_template(CHAT[:1])
    assert text.endswith("What is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_continue_final_message_leaves_the_last_message_open(tokenizer):
    options = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True)
    text = tokenizer.render_chat_template(CHAT, options)
    closed = tokenizer.render_chat_template(CHAT, ChatTemplateOptions(add_generation_prompt=False))
    assert text.endswith("<|im_start|>assistant\nThe capital of France is")
    assert closed == text + "<|im_end|>\n"  # the same prompt, only the end-of-turn marker left off
    ids = tokenizer.apply_chat_template(CHAT, options)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_template_kwargs_reach_the_template(tmp_path, tokenizer):
    custom = with_template(tmp_path, tokenizer, (
        "{% if persona is defined %}[{{ persona }}]{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"))
    assert custom.render_chat_template(CHAT[:1]).startswith("<|im_start|>user")
    options = ChatTemplateOptions(chat_template_kwargs={"persona": "pirate"})
    assert custom.render_chat_template(CHAT[:1], options).startswith("[pirate]<|im_start|>user")


@pytest.mark.parametrize("kwargs, error", [
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message: cannot be true"),
    ({"continue_final_message": True}, "set add_generation_prompt to false"),
    ({"chat_template_kwargs": {"messages": []}}, r"chat_template_kwargs\.messages: is set by the server"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "use the request's add_generation_prompt"),
    ({"chat_template_kwargs": {"eos_token": "x"}}, "is set by the server"),
    ({"chat_template_kwargs": {"not a name": 1}}, "is not a template variable name"),
    ({"chat_template_kwargs": [1]}, "must be an object"),
    ({"chat_template_kwargs": {f"v{i}": i for i in range(MAX_CHAT_TEMPLATE_KWARGS + 1)}}, "more than the limit"),
])
def test_bad_options_are_refused(kwargs, error):
    with pytest.raises(ValueError, match=error):
        ChatTemplateOptions(**kwargs)


def test_continuing_a_message_the_template_drops_is_refused(tokenizer, tmp_path):
    model = with_template(tmp_path, tokenizer,
                          "{% for m in messages %}{{ m['role'] }}{% endfor %}")
    options = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ValueError, match="chat template rejected the messages"):
        model.render_chat_template(CHAT, options)


def test_tools_and_tool_turns_reach_the_template(tmp_path, tokenizer):
    model = with_template(tmp_path, tokenizer, (
        "{% for t in tools or [] %}<tool>{{ t['function']['name'] }}</tool>{% endfor %}"
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
        "{% for c in m.get('tool_calls') or [] %}<call {{ c['id'] }}>{{ c['function']['arguments'] | tojson }}"
        "</call>{% endfor %}{% if m.get('tool_call_id') %}<answers {{ m['tool_call_id'] }}>{% endif %}|{% endfor %}"))
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    text = model.render_chat_template(messages, ChatTemplateOptions(tools=tools))
    # the arguments reach the template as an object, as templates that write `arguments | tojson` expect
    assert text == ('<tool>get_weather</tool>user:Weather?|assistant:<call c1>{"city": "Paris"}</call>|'
                    'tool:sunny<answers c1>|')
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the caller's, unchanged
    with pytest.raises(ValueError, match="tools: must be a list of objects"):
        ChatTemplateOptions(tools=["get_weather"])


def test_a_template_set_on_the_transformers_tokenizer_replaces_the_models(tokenizer):
    import copy

    from common.text.tokenizer import load_tokenizer
    shared = load_tokenizer(tokenizer.model_dir)
    custom = copy.copy(shared)
    custom.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    assert custom.render_chat_template(CHAT[:1]) == "<user>What is the capital of France?"
    assert shared.render_chat_template(CHAT[:1]) == tokenizer.render_chat_template(CHAT[:1])  # untouched


def test_documents_reach_retrieval_templates(tmp_path, tokenizer):
    model = with_template(tmp_path, tokenizer, (
        "{% for d in documents or [] %}<doc {{ d['title'] }}>{{ d['text'] }}</doc>{% endfor %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"))
    options = ChatTemplateOptions(documents=[{"title": "Paris", "text": "Capital of France."}])
    assert model.render_chat_template(CHAT[:1], options) == (
        "<doc Paris>Capital of France.</doc>What is the capital of France?")
    assert options.num_extra_chars == len('[{"title": "Paris", "text": "Capital of France."}]')
    for bad in ([{"title": 3}], "doc", [{"text": "x"}] * 129):
        with pytest.raises(ValueError, match="documents: must be a list"):
            ChatTemplateOptions(documents=bad)
