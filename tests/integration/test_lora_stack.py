"""LoRA adapters on the real stack (1 gateway, 1 prefill, 1 decode, the bundled model, both
instances started with --lora-modules): a request naming the adapter gives the offline
engine's tokens with it (prefilled remotely, its KV shipped), the base model's requests are
unchanged beside it, their cached blocks stay apart, /v1/models lists the adapter, and an
adapter nobody serves is refused. With --allow-runtime-lora-updating, adapters are loaded,
replaced and unloaded through the HTTP API on every instance, and one joining later gets them."""
from __future__ import annotations

import http.client
import json
import signal
import time

import grpc
import pytest
import torch

from common.cli.up import LocalStack
from common.engine.lora.request import LoRARequest
from common.engine.model_files import resolve_model
from common.engine.sampling_params import SamplingParams
from gateway.client import Client
from tests.integration.test_metrics import scrape
from tests.integration.test_stack import unique_long_prompts, wait_until_the_gateway_sees_no_load
from tests.support.peft_adapters import requires_peft

pytestmark = [pytest.mark.slow, requires_peft]

PROMPT = "Write one sentence about the sea and the harbour at dawn."
LONG_PROMPT = unique_long_prompts("lora-remote", 1)[0]  # long enough to be prefilled remotely
MAX_TOKENS = 12


def make_adapter(out, seed: int, targets: list[str]) -> str:
    """A PEFT adapter of the bundled model: random A and B over `targets` (a real change)."""
    import peft
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(resolve_model(), dtype=torch.float32)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets,
                             lora_dropout=0.0, init_lora_weights="gaussian")
    tuned = peft.get_peft_model(model, config)
    with torch.no_grad():  # PEFT leaves B at zero (no change); a trained adapter's B is not
        for name, param in tuned.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    tuned.save_pretrained(out, safe_serialization=True)
    return str(out)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> str:
    return make_adapter(tmp_path_factory.mktemp("lora") / "sea", 7, ["q_proj", "v_proj", "down_proj"])


@pytest.fixture(scope="module")
def lake_dir(tmp_path_factory) -> str:
    """Another adapter, loaded at run time."""
    return make_adapter(tmp_path_factory.mktemp("lora") / "lake", 11, ["k_proj", "o_proj", "up_proj"])


@pytest.fixture(scope="module")
def offline(adapter_dir, lake_dir):
    from common.engine.llm import LLM
    llm = LLM(enable_lora=True, kv_cache_memory="128MiB")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        sea = LoRARequest("sea", 1, adapter_dir)
        prompts = [PROMPT, LONG_PROMPT]
        lake = LoRARequest("lake", 2, lake_dir)
        return {"adapter": [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=sea)],
                "base": [o.outputs[0].token_ids for o in llm.generate(prompts, params)],
                "lake": [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=lake)]}
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def stack(adapter_dir, tmp_path_factory):
    with LocalStack(1, 1, passthrough=["--kv-cache-memory", "256MiB", "--log-level", "WARNING",
                                       "--lora-modules", f"sea={adapter_dir}", "--allow-runtime-lora-updating"],
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
    for role in ("prefill", "decode"):  # each instance's LoRA series: the adapter held, nothing in flight
        samples = scrape(stack.instances[f"{role}-0"].metrics_address)
        labels = frozenset({"role": role, "instance_id": f"{role}-0"}.items())
        assert samples[("pdserve_lora_adapters_held", labels)] == 1
        assert samples[("pdserve_lora_max_adapters", labels)] == 4  # --max-loras' default
        assert samples[("pdserve_lora_adapter_loads_total", labels)] >= 1
        assert not [name for name, _ in samples if name == "pdserve_lora_requests_running"]


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


def post(stack, path: str, body: dict) -> tuple[int, str]:
    connection = http.client.HTTPConnection(*stack.http_address.split(":"), timeout=120)
    try:
        connection.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def get(stack, path: str) -> str:
    connection = http.client.HTTPConnection(*stack.http_address.split(":"), timeout=60)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        assert response.status == 200
        return response.read().decode()
    finally:
        connection.close()


def document_models(stack) -> list[str]:
    """The model names the OpenAPI document lets a completion name."""
    document = json.loads(get(stack, "/openapi.json"))
    return document["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"]


def served_tokens(client: Client, model: str, prompt: str) -> list[int]:
    return client.generate(prompt, model=model, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                           return_token_ids=True).token_ids


def test_an_adapter_loaded_at_run_time_is_served_replaced_and_unloaded(stack, offline, adapter_dir, lake_dir):
    load, unload = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
    assert post(stack, load, {"lora_name": "lake", "lora_path": lake_dir}) == (
        200, "Success: LoRA adapter 'lake' added successfully.")
    assert document_models(stack)[1:] == ["lake", "sea"]  # the OpenAPI document follows
    with Client(stack.address, timeout=120) as client:
        for i, prompt in enumerate((PROMPT, LONG_PROMPT)):  # the decode instance's and the prefill instance's
            assert served_tokens(client, "lake", prompt) == offline["lake"][i]
        wait_until_the_gateway_sees_no_load(stack)
        status, body = post(stack, load, {"lora_name": "lake", "lora_path": adapter_dir})
        assert status == 400 and "already been loaded" in body and "load_inplace" in body
        status, body = post(stack, load, {"lora_name": "pond", "lora_path": "/nowhere/pond"})
        assert status == 400 and "no adapter_config.json" in body  # refused by the instances, undone
        base_model = client.model_info().model_name
        for bad in ({"lora_name": "lake"}, {"lora_name": "x", "lora_path": "/p", "rank": 4},
                    {"lora_name": "", "lora_path": "/p"}, {"lora_name": base_model, "lora_path": "/p"}):
            assert post(stack, load, bad)[0] == 400, bad

        # In place: the name now means sea's weights, and nothing cached under it serves them.
        assert post(stack, load, {"lora_name": "lake", "lora_path": adapter_dir, "load_inplace": True})[0] == 200
        for i, prompt in enumerate((PROMPT, LONG_PROMPT)):
            assert served_tokens(client, "lake", prompt) == offline["adapter"][i]
        wait_until_the_gateway_sees_no_load(stack)

        assert post(stack, unload, {"lora_name": "lake"}) == (200, "Success: LoRA adapter 'lake' removed successfully.")
        with pytest.raises(grpc.RpcError) as error:
            client.generate(PROMPT, model="lake")
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert post(stack, unload, {"lora_name": "lake"})[0] == 404
        assert served_tokens(client, "sea", PROMPT) == offline["adapter"][0]  # the others are untouched
    wait_until_the_gateway_sees_no_load(stack)
    models = json.loads(get(stack, "/v1/models"))
    assert [m["id"] for m in models["data"]][1:] == ["sea"] and document_models(stack)[1:] == ["sea"]


def test_an_instance_itself_refuses_what_it_cannot_do(stack, lake_dir):
    from protos.pdserve.v1 import lora_adapters_pb2, lora_adapters_pb2_grpc
    with grpc.insecure_channel(stack.instances["decode-0"].address) as channel:
        stub = lora_adapters_pb2_grpc.LoRAAdapterServiceStub(channel)
        for request, code in ((lora_adapters_pb2.LoadLoRAAdapterRequest(lora_name="sea", lora_path=lake_dir),
                               grpc.StatusCode.ALREADY_EXISTS),
                              (lora_adapters_pb2.LoadLoRAAdapterRequest(lora_name="sea"),
                               grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as error:
                stub.LoadLoRAAdapter(request, timeout=60)
            assert error.value.code() == code
        with pytest.raises(grpc.RpcError) as error:
            stub.UnloadLoRAAdapter(lora_adapters_pb2.UnloadLoRAAdapterRequest(lora_name="lake"), timeout=60)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_instance_that_joins_later_gets_the_adapters_loaded_at_run_time_even_from_a_restarted_gateway(
        stack, offline, lake_dir):
    assert post(stack, "/v1/load_lora_adapter", {"lora_name": "lake", "lora_path": lake_dir})[0] == 200
    try:
        # The gateway that made the load forgets it: the restarted one learns lake and its path
        # from the instances' registrations, which say it was loaded at run time.
        stack.kill_gateway(0)
        stack.restart_gateway(0)
        stack.wait_registered(1, 1, timeout_s=60)
        joined = stack.add_instance("decode")
        stack.kill("decode-0", signal.SIGTERM)  # the old one leaves (deregisters): only the new one is left
        stack.instances["decode-0"].wait_or_kill(stack.grace_s)
        deadline = time.monotonic() + 60
        with Client(stack.address, timeout=120) as client:
            while True:  # until the gateway has loaded lake on the new instance
                try:
                    result = client.generate(PROMPT, model="lake", max_tokens=MAX_TOKENS, temperature=0,
                                             ignore_eos=True, return_token_ids=True)
                    break
                except grpc.RpcError as error:
                    # No live decode instance serves it yet (the prefill instance does).
                    assert error.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, error
                    time.sleep(0.1)
            assert result.decode_instance_id == joined.name and result.token_ids == offline["lake"][0]
    finally:
        post(stack, "/v1/unload_lora_adapter", {"lora_name": "lake"})
