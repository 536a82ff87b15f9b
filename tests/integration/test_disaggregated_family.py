"""A disaggregated stack serving a non-Llama model: a tiny random Gemma 2 (head_dim 16,
not hidden / heads; alternating sliding windows; soft-capping) prefilled by one process
and decoded by another over ZeroMQ gives the offline engine's greedy tokens, so the
KV pool geometry and the per-layer attention features survive the transfer."""
from __future__ import annotations

import asyncio
import time

import pytest

from tests.integration.test_workers import READY_TIMEOUT_S, RegistryServer, ServiceProcess, decode_collect, run
from tests.unit.common.engine.models.family_parity import parity_prompts, save_tiny_model

pytestmark = pytest.mark.slow

ENGINE_FLAGS = ["--kv-cache-memory", "16MiB", "--max-num-batched-tokens", "16", "--block-size", "8"]
NUM_TOKENS = 24


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory, bundled_model_dir):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    return save_tiny_model(tmp_path_factory.mktemp("gemma2"), Gemma2Config, Gemma2ForCausalLM, bundled_model_dir,
                           head_dim=16, query_pre_attn_scalar=24, sliding_window=8, pad_token_id=0,
                           initializer_range=0.1, tie_word_embeddings=False)


def test_remote_prefill_of_gemma2_matches_offline(tmp_path, gemma2_dir):
    from common import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    prompts = [p for p in parity_prompts() if len(p) > 8]  # long enough to go remote
    offline = LLM(model=str(gemma2_dir), kv_cache_memory="16MiB", max_num_batched_tokens=16, block_size=8)
    expected = [o.outputs[0].token_ids for o in offline.generate([{"prompt_token_ids": p} for p in prompts],
                                                                   params)]
    registry = RegistryServer()
    gateway = ["--gateway", f"127.0.0.1:{registry.port}", "--model", str(gemma2_dir)]
    prefill = ServiceProcess("prefill_service.main", ["--instance-id", "prefill-test", *gateway, *ENGINE_FLAGS],
                             tmp_path / "prefill.log")
    decode = ServiceProcess("decode_service.main",
                            ["--instance-id", "decode-test", *gateway, "--kv-transfer-timeout", "20",
                             "--local-prefill-threshold", "4", *ENGINE_FLAGS], tmp_path / "decode.log")
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        prefill.wait_ready(deadline)
        decode.wait_ready(deadline)

        async def main():
            return await asyncio.gather(*(decode_collect(decode.address, p, params, prefill=prefill.address)
                                          for p in prompts))

        results = run(main())
        for prompt, want, result in zip(prompts, expected, results):
            assert result["token_ids"] == want, (len(prompt), decode.log_tail())
            assert result["prefill"] == "prefill-test"
    finally:
        codes = [p.stop() for p in (decode, prefill)]
        registry.close()
    assert codes == [0, 0], (prefill.log_tail(), decode.log_tail())
