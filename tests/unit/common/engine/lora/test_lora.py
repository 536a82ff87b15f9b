"""LoRA adapters in the engine, against PEFT itself: a PEFT adapter (random A and B, every
decoder linear, rsLoRA too) served on the base model, compiled, gives what PEFT's merged
model gives, with no recompile for any mix of adapters;
one batch mixes adapters and the base model, each row its own; cached blocks are the
adapter's own; an adapter the model cannot serve is refused with nothing left behind; at
most max_loras are held, one no live request uses dropped for a new one."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.engine.errors import LoRAAdaptersBusyError
from common.engine.llm import LLM
from common.engine.lora.request import LoRARequest
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams
from tests.support.peft_adapters import make_adapter, requires_peft

pytestmark = requires_peft

PROMPTS = [list(range(10, 30)), list(range(300, 309)), [5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)


@pytest.fixture(scope="module")
def llm(base_dir):
    engine = LLM(model=str(base_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
                 num_kv_blocks=64, block_size=8, max_num_batched_tokens=32)
    yield engine
    engine.engine.shutdown()


def lora(adapters, name: str, int_id: int) -> LoRARequest:
    return LoRARequest(name, int_id, adapters[name][0])


def outputs(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


def merged_outputs(merged_dir: Path) -> list:
    engine = LLM(model=str(merged_dir), dtype="float32", num_kv_blocks=64, block_size=8, enforce_eager=True)
    try:
        return engine.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    finally:
        engine.engine.shutdown()


def test_an_adapter_gives_what_peft_s_merged_model_gives(llm, adapters):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]  # 20 tokens: chunked over the 32-token budget with others
    base = llm.generate(prompts, GREEDY)
    for int_id, name in enumerate(("a", "b"), start=1):
        served = llm.generate(prompts, GREEDY, lora_request=lora(adapters, name, int_id))
        want = merged_outputs(adapters[name][1])
        assert outputs(served) == outputs(want), name
        for got, ref in zip(served, want):
            assert [lp.token_logprob for lp in got.outputs[0].logprobs] == pytest.approx(
                [lp.token_logprob for lp in ref.outputs[0].logprobs], abs=1e-3)
        assert outputs(served) != outputs(base)  # the adapter changed something


def test_an_adapter_of_a_fused_checkpoint_targets_its_fused_linears(tmp_path, bundled_model_dir):
    """Phi-3 stores qkv_proj and gate_up_proj fused, and its adapters target them so."""
    from transformers import Phi3Config, Phi3ForCausalLM

    from tests.unit.common.engine.models.family_parity import save_tiny_model
    base = save_tiny_model(tmp_path / "phi3", Phi3Config, Phi3ForCausalLM, bundled_model_dir, pad_token_id=0)
    adapter, merged = make_adapter(base, tmp_path / "fused", seed=4,
                                   targets=("qkv_proj", "gate_up_proj", "o_proj", "down_proj"))
    engine = LLM(model=str(base), dtype="float32", enable_lora=True, num_kv_blocks=64, block_size=8)
    try:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        served = engine.generate(prompts, GREEDY, lora_request=LoRARequest("fused", 1, adapter))
        assert outputs(served) == outputs(merged_outputs(merged))
        assert outputs(served) != outputs(engine.generate(prompts, GREEDY))
    finally:
        engine.engine.shutdown()


def test_one_batch_mixes_adapters_and_the_base_model(llm, adapters):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    per_prompt = [None, lora(adapters, "a", 1), lora(adapters, "b", 2)]
    mixed = llm.generate(prompts, GREEDY, lora_request=per_prompt)
    alone = [llm.generate(prompt, GREEDY, lora_request=l)[0] for prompt, l in zip(prompts, per_prompt)]
    assert outputs(mixed) == outputs(alone)


def test_a_step_mixing_adapters_runs_its_last_layer_on_the_sampled_rows_alone(llm, adapters, monkeypatch):
    """The last layer's MLP (adapters' deltas and all) runs on the rows a step samples, each
    with its own adapter's delta: the same tokens and logprobs as with every row kept."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    per_prompt = [lora(adapters, "b", 2), None, lora(adapters, "a", 1)]
    runner = llm.engine.executor.runner
    last_mlp = runner.model.layers[-1].mlp
    num_rows: list[int] = []
    hook = last_mlp.register_forward_pre_hook(lambda module, args: num_rows.append(args[0].shape[0]))
    try:
        llm.reset_prefix_cache()
        kept = llm.generate(prompts, GREEDY, lora_request=per_prompt)
        assert num_rows[0] < 32  # the first step's 32 prompt tokens, one or two of them sampled
        llm.reset_prefix_cache()
        num_rows.clear()
        monkeypatch.setattr(runner, "_kept_rows", lambda scheduler_output, num_tokens, sample_indices:
                            torch.arange(num_tokens))
        every_row = llm.generate(prompts, GREEDY, lora_request=per_prompt)
        assert num_rows[0] == 32
    finally:
        hook.remove()
    assert outputs(kept) == outputs(every_row)
    for got, want in zip(kept, every_row):
        torch.testing.assert_close(torch.tensor([lp.token_logprob for lp in got.outputs[0].logprobs]),
                                   torch.tensor([lp.token_logprob for lp in want.outputs[0].logprobs]),
                                   atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def compiled(base_dir):
    """The fixture's engine, compiled (the suite runs engines eagerly unless a test asks)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("PDSERVE_ENFORCE_EAGER", raising=False)
        engine = LLM(model=str(base_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
                     num_kv_blocks=64, block_size=8, max_num_batched_tokens=32)
    yield engine
    engine.engine.shutdown()


def test_compiled_the_deltas_run_inside_the_graph_as_eagerly_and_without_recompiles(compiled, llm, adapters):
    from common.engine.compilation import num_compiled_graphs
    runner = compiled.engine.executor.runner
    assert runner.forward is not runner.model  # compiled, the deltas an op inside it
    loop = runner.native_decode  # its decode steps add the deltas themselves (tests: test_native_loop.py)
    assert loop is not None
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    per_prompt = [lora(adapters, "a", 1), None, lora(adapters, "b", 2)]
    for loras in (per_prompt, lora(adapters, "a", 1), None):
        num_loop_steps = loop.num_steps
        assert outputs(compiled.generate(prompts, GREEDY, lora_request=loras)) == \
            outputs(llm.generate(prompts, GREEDY, lora_request=loras))
        assert loop.num_steps > num_loop_steps  # the decode steps ran in the loop
    before = num_compiled_graphs()
    for num_prompts, loras in ((1, lora(adapters, "a", 1)), (3, [None, lora(adapters, "b", 2), None]),
                               (5, lora(adapters, "b", 2)), (2, None)):
        compiled.generate([{"prompt_token_ids": list(range(7, 7 + 5 * (i + 1)))} for i in range(num_prompts)],
                          GREEDY, lora_request=loras)
    assert num_compiled_graphs() == before


def test_cached_blocks_belong_to_their_adapter(llm, adapters):
    llm.reset_prefix_cache()
    prompt = {"prompt_token_ids": list(range(1000, 1024))}
    one = SamplingParams(max_tokens=1, temperature=0.0)
    assert llm.generate(prompt, one)[0].num_cached_tokens == 0
    assert llm.generate(prompt, one, lora_request=lora(adapters, "a", 1))[0].num_cached_tokens == 0
    assert llm.generate(prompt, one, lora_request=lora(adapters, "a", 1))[0].num_cached_tokens == 16
    assert llm.generate(prompt, one)[0].num_cached_tokens == 16


def write_adapter(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return str(directory)


def test_an_adapter_the_model_cannot_serve_is_refused_with_nothing_left(llm, adapters, tmp_path):
    good = adapters["a"][0]
    config = json.loads((Path(good) / "adapter_config.json").read_text())
    tensors = load_file(str(Path(good) / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    bin_only = tmp_path / "bin_only"
    bin_only.mkdir()
    (bin_only / "adapter_config.json").write_text(json.dumps(config))
    (bin_only / "adapter_model.bin").write_bytes(b"pickle")
    cases = {
        str(tmp_path / "missing"): "no adapter_config.json",
        str(bin_only): "pickle, which is not loaded",
        write_adapter(tmp_path / "rank", {**config, "r": 16}, tensors): "rank 16 is above max_lora_rank 8",
        write_adapter(tmp_path / "saved", {**config, "modules_to_save": ["lm_head"]}, tensors): "modules_to_save",
        write_adapter(tmp_path / "dora", {**config, "use_dora": True}, tensors): "DoRA",
        write_adapter(tmp_path / "embed", config, {**tensors, "base_model.model.model.embed_tokens.lora_A.weight":
                                                   torch.zeros(4, 49152)}): "embeddings, the LM head",
        write_adapter(tmp_path / "shape", config, {**tensors, key: torch.zeros(4, 32)}): "another base model",
        write_adapter(tmp_path / "half", config, {k: v for k, v in tensors.items() if k != key}): "lora_B only",
        write_adapter(tmp_path / "layer", config, {**tensors, key.replace("layers.0", "layers.9"):
                                                   tensors[key].clone()}): "for layer 9",
    }
    llm.generate([{"prompt_token_ids": [5, 6]}] * 2, GREEDY, lora_request=[lora(adapters, "a", 1),
                                                                          lora(adapters, "b", 2)])
    held = list(llm.engine._held_loras)  # max_loras 2: every slot held, none in use
    for path, message in cases.items():
        with pytest.raises(ValueError, match=message):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, GREEDY, lora_request=LoRARequest("bad", 9, path))
        assert not llm.engine.has_unfinished_requests()
        assert list(llm.engine._held_loras) == held  # a refused adapter takes no held one's slot
        assert llm.engine.executor.collective_rpc("lora_names") == [sorted(held)]
    llm.generate({"prompt_token_ids": [5, 6]}, GREEDY, lora_request=lora(adapters, "a", 1))  # "a" held
    with pytest.raises(ValueError, match="one name, one adapter"):
        llm.generate({"prompt_token_ids": [5, 6]}, GREEDY, lora_request=LoRARequest("a", 1, adapters["b"][0]))
    with pytest.raises(ValueError, match="lora_int_id must be"):
        LoRARequest("x", 0, good)
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, lora_request=lora(adapters, "a", 1))


def test_at_most_max_loras_are_held_and_one_in_use_is_not_dropped(llm, adapters, tmp_path):
    third = LoRARequest("c", 3, make_adapter(Path(llm.engine.model_dir), tmp_path / "c", seed=3)[0])
    with pytest.raises(ValueError, match="names 3 LoRA adapters"):
        llm.generate([{"prompt_token_ids": [5]}] * 3, GREEDY,
                     lora_request=[lora(adapters, "a", 1), lora(adapters, "b", 2), third])
    llm.generate({"prompt_token_ids": [5, 6]}, GREEDY, lora_request=lora(adapters, "a", 1))
    llm.generate({"prompt_token_ids": [5, 6]}, GREEDY, lora_request=lora(adapters, "b", 2))  # a and b held
    live = Request("live", [5, 6, 7], SamplingParams(max_tokens=400), lora_request=lora(adapters, "a", 1))
    llm.engine.add_request(live)  # a in use: c takes b's place
    assert llm.generate({"prompt_token_ids": [5, 6]}, GREEDY, lora_request=third)
    blocked = Request("blocked", [5, 6], SamplingParams(max_tokens=2), lora_request=lora(adapters, "b", 2))
    llm.engine.add_request(Request("live-c", [5, 6], SamplingParams(max_tokens=400), lora_request=third))
    with pytest.raises(LoRAAdaptersBusyError, match="are in use by requests"):
        llm.engine.add_request(blocked)  # a and c both in use
    stats = llm.engine.stats()
    llm.engine.abort_requests(["live", "live-c"])
    assert not llm.engine.has_unfinished_requests()
    assert stats["lora_requests_running"] == {"a": 1} and stats["lora_requests_waiting"] == {"c": 1}  # no step yet
    assert (stats["lora_adapters_held"], stats["lora_max_adapters"]) == (2, 2)
    loads, evictions = stats["lora_adapter_loads"], stats["lora_adapter_evictions"]
    assert llm.generate({"prompt_token_ids": [5, 6]}, GREEDY, lora_request=lora(adapters, "b", 2))
    stats = llm.engine.stats()  # b took the place of a, the least recently used
    assert (stats["lora_adapter_loads"], stats["lora_adapter_evictions"]) == (loads + 1, evictions + 1)
    assert stats["lora_requests_running"] == {}


def test_an_engine_without_lora_refuses_an_adapter(base_dir, adapters):
    engine = LLM(model=str(base_dir), dtype="float32", num_kv_blocks=32, enforce_eager=True)
    try:
        with pytest.raises(ValueError, match="serves none"):
            engine.generate({"prompt_token_ids": [5]}, GREEDY, lora_request=lora(adapters, "a", 1))
        assert not engine.engine.has_unfinished_requests()
    finally:
        engine.engine.shutdown()


def test_speculation_leaves_each_adapter_s_greedy_tokens_unchanged(llm, base_dir, adapters):
    # Drafts come without the adapters (the proposer runs outside the step's LoRA rows); the
    # target verifies them with them, so only the acceptance rate can differ. The early-exit
    # proposer drafts at every step (an n-gram one finds nothing in a random model's output).
    speculating = LLM(model=str(base_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
                      num_kv_blocks=64, block_size=8, max_num_batched_tokens=32, enforce_eager=True,
                      speculative_config={"method": "early_exit", "num_early_exit_layers": 1,
                                          "num_speculative_tokens": 2, "min_acceptance_rate": 0.0,
                                          "disable_by_batch_size": None})
    try:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        per_prompt = [lora(adapters, "a", 1), None, lora(adapters, "b", 2)]
        assert outputs(speculating.generate(prompts, GREEDY, lora_request=per_prompt)) == \
            outputs(llm.generate(prompts, GREEDY, lora_request=per_prompt))
        assert speculating.engine.stats()["spec_num_draft_tokens"] > 0
    finally:
        speculating.engine.shutdown()


def test_an_adapter_loaded_at_run_time_replaces_its_name_s_and_its_cached_blocks(llm, adapters, tmp_path):
    llm.reset_prefix_cache()
    prompt = {"prompt_token_ids": list(range(2000, 2024))}
    first = LoRARequest("x", 11, adapters["a"][0])
    want_a = llm.generate(prompt, GREEDY, lora_request=first)[0]
    assert llm.generate(prompt, GREEDY, lora_request=first)[0].num_cached_tokens == 16
    want_b = llm.generate(prompt, GREEDY, lora_request=lora(adapters, "b", 2))[0]
    assert want_a.outputs[0].token_ids != want_b.outputs[0].token_ids

    live = Request("live-x", [5, 6, 7], SamplingParams(max_tokens=400), lora_request=first)
    llm.engine.add_request(live)
    with pytest.raises(LoRAAdaptersBusyError, match="'x' is in use by 1 requests"):
        llm.engine.load_lora(LoRARequest("x", 12, adapters["b"][0]))
    llm.engine.abort_requests(["live-x"])
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.engine.load_lora(LoRARequest("x", 12, str(tmp_path / "missing")))
    assert llm.generate(prompt, GREEDY, lora_request=first)[0].num_cached_tokens == 16  # nothing changed

    replaced = LoRARequest("x", 12, adapters["b"][0])
    llm.engine.load_lora(replaced)  # the name now means b's weights: its cached blocks must go
    got = llm.generate(prompt, GREEDY, lora_request=replaced)[0]
    assert got.num_cached_tokens == 0 and got.outputs[0].token_ids == want_b.outputs[0].token_ids

    llm.engine.unload_lora("x")  # not held any more: the name may come back with other weights
    again = llm.generate(prompt, GREEDY, lora_request=LoRARequest("x", 13, adapters["a"][0]))[0]
    assert again.outputs[0].token_ids == want_a.outputs[0].token_ids


def test_with_every_slot_in_use_a_loaded_adapter_is_checked_and_held_on_first_use(llm, adapters, tmp_path):
    in_use = [Request(f"live-{name}", [5, 6, 7], SamplingParams(max_tokens=400),
                      lora_request=lora(adapters, name, i)) for i, name in enumerate(("a", "b"), start=1)]
    for request in in_use:
        llm.engine.add_request(request)  # max_loras 2: both slots in use
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.engine.load_lora(LoRARequest("y", 21, str(tmp_path / "missing")))
    later = LoRARequest("y", 21, adapters["a"][0])
    llm.engine.load_lora(later)
    llm.engine.abort_requests([r.req_id for r in in_use])
    assert not llm.engine.has_unfinished_requests()
    assert outputs(llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=later)) == outputs(
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=lora(adapters, "a", 1)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_deltas_are_each_row_s_own_adapter_s_packed_or_not(base_dir, adapters, dtype):
    from common.engine.config import ModelConfig
    from common.engine.lora.adapter import load_adapter
    from common.engine.lora.layers import ADD_IN_MATMUL_ROWS, add_lora_deltas, linear_layouts, lora_step, stack_adapter
    from common.engine.model_files import load_hf_config
    from common.engine.models.prepacked_linear import prepacking_available
    cfg = ModelConfig.from_hf_config(load_hf_config(base_dir))
    adapter = load_adapter("a", adapters["a"][0], cfg, 8, dtype, torch.device("cpu"))
    stack_adapter(adapter, linear_layouts(cfg), range(cfg.num_hidden_layers))
    # bf16 runs packed where oneDNN packs bf16 (a decode row's matmuls ~4x faster); fp32 as torch's.
    assert bool(adapter.packed) == (dtype == torch.bfloat16 and prepacking_available(dtype))
    torch.manual_seed(0)
    # A chunk of ADD_IN_MATMUL_ROWS rows or more of one adapter adds in its expand's matmul.
    for (layer, linear_name), num_tokens in itertools.product(((0, "qkv_proj"), (1, "down_proj")),
                                                              (5, ADD_IN_MATMUL_ROWS + 44)):
        a, b = adapter.stacked[(layer, linear_name)]
        x = torch.randn(num_tokens, a.shape[1]).to(dtype)  # [num_tokens, in_features]
        want = (x.float() @ a.float().t()) @ b.float().t() * adapter.scaling  # [num_tokens, out_features]
        for rows in (None, torch.tensor([0, 3])):
            y = torch.ones(num_tokens, b.shape[0], dtype=dtype)
            with lora_step([(adapter, rows)], num_tokens):
                add_lora_deltas(y, x, layer, linear_name)
            picked = slice(None) if rows is None else rows
            tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
            torch.testing.assert_close(y[picked].float(), 1 + want[picked], **tolerance)
            if rows is not None:  # the other rows keep the base output
                assert (y[[1, 2, 4]] == 1).all()
