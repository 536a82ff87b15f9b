"""The model's recommended sampling defaults (vLLM's --generation-config): read as vLLM reads
them (transformers' own defaults left out), from the model, a folder or nothing, with
overrides; every bad value refused naming where it came from."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.engine.generation_config import SamplingDefaults, load_sampling_defaults

QWEN3_LIKE = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6, "top_p": 0.95,
              "top_k": 20, "repetition_penalty": 1.0, "max_new_tokens": 512}


def model_dir(tmp_path: Path, config: dict | None) -> Path:
    if config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_auto_takes_the_models_sampling_and_bounds_max_tokens_by_max_new_tokens(tmp_path):
    defaults = load_sampling_defaults(model_dir(tmp_path, QWEN3_LIKE))
    # repetition_penalty 1.0 is transformers' default: vLLM reads no value there.
    assert defaults == SamplingDefaults(sampling={"temperature": 0.6, "top_p": 0.95, "top_k": 20}, max_tokens=512)
    assert defaults.describe() == "temperature=0.6, top_p=0.95, top_k=20, max_tokens=512"


def test_values_equal_to_transformers_defaults_are_no_values(tmp_path):
    config = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0, "min_p": 0.0}
    assert load_sampling_defaults(model_dir(tmp_path, config)).sampling == {"min_p": 0.0}


def test_a_model_without_the_file_has_no_defaults(tmp_path):
    assert load_sampling_defaults(model_dir(tmp_path, None)) == SamplingDefaults()
    assert not load_sampling_defaults(tmp_path)


def test_vllm_keeps_none_and_overrides_apply_whatever_the_source(tmp_path):
    folder = model_dir(tmp_path, QWEN3_LIKE)
    assert not load_sampling_defaults(folder, "vllm")
    assert load_sampling_defaults(folder, "vllm", {"temperature": 0.5}) == SamplingDefaults({"temperature": 0.5})
    # An override replaces a value (top_k 50 included: overrides are taken as given) or, as null, removes it.
    overridden = load_sampling_defaults(folder, "auto", {"top_k": 50, "max_new_tokens": None, "top_p": None})
    assert overridden == SamplingDefaults(sampling={"temperature": 0.6, "top_k": 50})


def test_a_folder_is_read_instead_of_the_model(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    model_dir(other, {"temperature": 0.3})
    assert load_sampling_defaults(model_dir(tmp_path, QWEN3_LIKE), str(other)).sampling == {"temperature": 0.3}
    with pytest.raises(ValueError, match=r"--generation-config '.*missing': not 'auto', 'vllm' or a folder"):
        load_sampling_defaults(tmp_path, str(tmp_path / "missing"))


@pytest.mark.parametrize("config, match", [
    ({"temperature": -1}, r"generation_config.json: temperature=-1 is not a valid value"),
    ({"top_p": 0}, r"top_p=0 is not"),
    ({"top_k": 2.5}, r"top_k=2.5 is not"),
    ({"max_new_tokens": 0}, r"max_new_tokens=0 is not"),
    ({"repetition_penalty": "high"}, r'repetition_penalty="high" is not'),
    ([1, 2], r"must hold a JSON object"),
])
def test_a_bad_file_is_refused_naming_it_and_the_field(tmp_path, config, match):
    with pytest.raises(ValueError, match=match):
        load_sampling_defaults(model_dir(tmp_path, config))


def test_a_file_that_is_not_json_and_bad_overrides_are_refused(tmp_path):
    (tmp_path / "generation_config.json").write_text("{temperature: 0.6")
    with pytest.raises(ValueError, match="cannot read it as JSON"):
        load_sampling_defaults(tmp_path)
    with pytest.raises(ValueError, match=r"--override-generation-config: unknown field 'seed'"):
        load_sampling_defaults(tmp_path, "vllm", {"seed": 1})
    with pytest.raises(ValueError, match=r"--override-generation-config: min_p=2 is not a valid value"):
        load_sampling_defaults(tmp_path, "vllm", {"min_p": 2})
