"""LoRA adapters on the real stack (1 gateway, 1 prefill, 1 decode, the bundled model, both
instances started with --lora-modules): a request naming the adapter gives the offline
engine's tokens with it (prefilled remotely, its KV shipped), the base model's requests are
unchanged beside it, their cached blocks stay apart, /v1/models lists the adapter, and an
adapter nobody serves is refused."""
from __future__ import annotations

import grpc
import pytest
import torch

from common.cli.up import LocalStack
from common.engine.lora.request import LoRARequest
from common.engine.model_files import resolve_model
from common.engine.sampling_params import SamplingParams
from gateway.client import Client
from tests.integration.test_stack import unique_long_prompts, wait_until_the_gateway_sees_no_load

pytestmark = pytest.mark.slow
peft = pytest.importorskip("peft")

PROMPT = "Write one sentence about the sea and the harbour at dawn."
LONG_PROMPT = unique_long_prompts("lora-remote", 1)[0]  # long enough to be prefilled remotely
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> str:
    """A PEFT adapter of the bundled model: random A and B over q, v and down (a real change)."""
    import transformers
    out = tmp_path_factory.mktemp("lora") / "sea"
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_pretrained(resolve_model(), dtype=torch.float32)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                             lora_dropout=0.0, init_lora_weights="gaussian")
    tuned = peft.get_peft_model(model, config)
    with torch.no_grad():  # PEFT leaves B at zero (no change); a trained adapter's B is not
        for name, param in tuned.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    tuned.save_pretrained(out, safe_serialization=True)
    return str(out)


@pytest.fixture(scope="module")
def offline(adapter_dir):
    from common.engine.llm import LLM
    llm = LLM(enable_lora=True, kv_cache_memory="128MiB")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        sea = LoRARequest("sea", 1, adapter_dir)
        prompts = [PROMPT, LONG_PROMPT]
        return {"adapter": [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=sea)],
                "base": [o.outputs[0].token_ids for o in llm.generate(prompts, params)]}
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def stack(adapter_dir, tmp_path_factory):
    with LocalStack(1, 1, passthrough=["--kv-cache-memory", "256MiB", "--log-level", "WARNING",
                                       "--lora-modules", f"sea={adapter_dir}"],
                    log_dir=tmp_path_factory.mktemp("lora-stack-logs")) as local_stack:
        yield local_stack


def test_the_adapter_gives_the_offline_engines_tokens_and_the_base_model_its_own(stack, offline):
    assert offline["adapter"][0] != offline["base"][0]  # the adapter changes the answer
    with Client(stack.address, timeout=120) as client:
        for i, prompt in enumerate((PROMPT, LONG_PROMPT)):  # prefilled on the decode instance, then remotely
            served = client.generate(prompt, model="sea", max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                     return_token_ids=True)
            assert served.token_ids == offline["adapter"][i]
            assert served.prefill_instance_id.startswith("prefill-") == (prompt is LONG_PROMPT)
            plain = client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                    return_token_ids=True)
            assert plain.token_ids == offline["base"][i]
            wait_until_the_gateway_sees_no_load(stack)


def test_cached_blocks_stay_with_their_adapter(stack):
    fresh = unique_long_prompts("lora", 1)[0]
    with Client(stack.address, timeout=120) as client:
        first = client.generate(fresh, model="sea", max_tokens=2, temperature=0)
        wait_until_the_gateway_sees_no_load(stack)
        assert client.generate(fresh, max_tokens=2, temperature=0).usage.cached_prompt_tokens == 0
        wait_until_the_gateway_sees_no_load(stack)
        again = client.generate(fresh, model="sea", max_tokens=2, temperature=0)
        assert again.usage.cached_prompt_tokens >= 16 * (again.usage.prompt_tokens // 16 - 1), again
        assert again.text == first.text
    wait_until_the_gateway_sees_no_load(stack)


def test_models_lists_the_adapter_and_an_unknown_one_is_refused(stack):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://{stack.http_address}/v1", api_key="unused", max_retries=0, timeout=120)
    names = [m.id for m in client.models.list().data]
    assert names[1:] == ["sea"]
    completion = client.completions.create(model="sea", prompt=PROMPT, max_tokens=4, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert completion.model == "sea" and completion.usage.completion_tokens == 4
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="lake", prompt=PROMPT, max_tokens=4)
    with Client(stack.address, timeout=120) as grpc_client:
        with pytest.raises(grpc.RpcError) as error:
            grpc_client.generate(PROMPT, model="lake")
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    wait_until_the_gateway_sees_no_load(stack)
