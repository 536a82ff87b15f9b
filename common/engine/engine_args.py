"""The engine's command-line flags, shared by `pdserve generate-offline` and both services,
and the EngineConfig they describe (the services' counterpart of LLM(...))."""
from __future__ import annotations

import argparse

from common.engine.config import KV_CACHE_DTYPE_NAMES, make_engine_config


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face directory; default: bundled SmolLM2-135M-Instruct")
    g.add_argument("--dtype", default="auto",
                   help="auto (bf16 on CUDA and on CPUs with AMX or AVX512-BF16, else fp32), float32, bfloat16, "
                        "float16")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-kv-blocks-ahead", type=int, default=7,
                   help="KV blocks a request takes past what it needs when it needs more, while over half "
                        "the pool is empty and no more than its max_tokens can fill, so its KV grows in runs "
                        "the attention reads as streams (0: one block at a time)")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size: bytes (2GiB, 512MiB) or a fraction of free memory after weights "
                        "(0.9); default 1GiB on CPU, 0.9 on GPU")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_NAMES, default="auto",
                   help="what the KV pool holds: auto (the model's dtype) or 8-bit float codes, as vLLM's "
                        "flag (fp8 = fp8_e4m3; no scales): half of bf16's bytes, so twice the tokens per "
                        "pool and decode attention reads half as much (CPU, and CUDA from compute capability 8.9; "
                        "float32 and bfloat16 models)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output; default min(model limit, KV capacity)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests running per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="most tokens of one prompt per step (vLLM's flag): a long prompt is prefilled in "
                        "chunks of this size beside the other requests, so decode steps stay short and short "
                        "prompts start sooner, at the cost of the long prompt's first token; 0: no cap "
                        "beyond --max-num-batched-tokens")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--no-chunked-prefill", action="store_true", help="disable chunked prefill")
    # vLLM's spellings of the two, so a vLLM launch line runs as it is.
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="vLLM's flag: --no-enable-prefix-caching is --no-prefix-caching (on by default)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="vLLM's flag: --no-enable-chunked-prefill is --no-chunked-prefill (on by default)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM launch lines; changes nothing: pdserve runs no code from a "
                        "checkpoint (it serves the model families it implements itself)")
    g.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="decode steps one scheduling may run back to back where every running request "
                        "decodes greedily and none waits (vLLM's flag): the engine's per-step work is paid "
                        "once for them; tokens reach clients in bursts of that many (CPU native decode loop; "
                        "elsewhere one step)")
    g.add_argument("--speculative-config", default=None,
                   help='speculative decoding as JSON, like vLLM: {"method": "ngram", '
                        '"num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}; '
                        'methods ngram, early_exit (num_early_exit_layers), draft_model (draft_model)')
    g.add_argument("--pooler-config", default=None,
                   help='embeddings: the pooling as JSON, over what the model\'s sentence-transformers '
                        'config says, like vLLM: {"pooling_type": "MEAN", "normalize": false}; pooling_type '
                        'LAST, MEAN, CLS, MAX, MEAN_SQRT_LEN or WEIGHTED_MEAN')
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks each layer is split over (one worker process each)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline stages the layers are split into (one worker process each)")
    g.add_argument("--distributed-executor-backend", choices=["uni", "mp"], default=None,
                   help="uni: the model runs in this process; mp: one worker process per rank; "
                        "default uni for one rank, mp for more")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run the model eagerly instead of compiling it with torch.compile")
    g.add_argument("--quantization", choices=["gguf", "int8"], default=None,
                   help="gguf: serve a GGUF's own quantized weights (Q4_1, Q8_0) as stored; "
                        "int8: int8 weight-only; default: weights in --dtype")
    g.add_argument("--single-weight-copy", action=argparse.BooleanOptionalAction, default=False,
                   help="CPU, bf16 with AVX512-BF16 (no AMX): keep each linear's weight once, in the "
                        "column panels the decode kernel reads, for steps of every size, instead of adding "
                        "oneDNN's packed copy for long prefill chunks: half the weight memory, prefill "
                        "chunks of ~2,000 tokens ~10%% slower; meant for decode instances (`pdserve up`, "
                        "compose and the manifests set it for theirs)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (implied by --lora-modules; loaded at run time through the "
                        "gateway's --allow-runtime-lora-updating); CUDA graphs are then off")
    g.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                   help="PEFT LoRA adapters this instance serves, each by NAME: a request whose model is "
                        "NAME runs with it (vLLM's flag; may be given more than once)")
    g.add_argument("--max-loras", type=int, default=4, help="LoRA adapters held at once")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest LoRA rank served")
    g.add_argument("--num-threads", type=int, default=None,
                   help="torch threads of this process (set it so processes sharing a host do not "
                        "oversubscribe its cores); default: one per core, no more than the "
                        "container's CPU quota")
    g.add_argument("--num-prefill-threads", type=int, default=None,
                   help="CPU: torch threads for steps that prefill at least 32 prompt tokens "
                        "(default: --num-threads); `pdserve up` gives a lone decode instance that "
                        "prefills the gateway's reserved cores for those steps")


def _enabled(args: argparse.Namespace, feature: str) -> bool:
    """--no-<feature> or vLLM's --[no-]enable-<feature>; contradicting each other is an error."""
    off, enable = getattr(args, f"no_{feature}"), getattr(args, f"enable_{feature}", None)
    if off and enable:
        flag = feature.replace("_", "-")
        raise ValueError(f"--no-{flag} contradicts --enable-{flag}: give one of them")
    return not off and enable is not False


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
                block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                kv_cache_dtype=args.kv_cache_dtype,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=_enabled(args, "prefix_caching"),
                enable_chunked_prefill=_enabled(args, "chunked_prefill"),
                num_scheduler_steps=args.num_scheduler_steps,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                num_kv_blocks_ahead=args.num_kv_blocks_ahead,
                speculative_config=getattr(args, "speculative_config", None),
                tensor_parallel_size=args.tensor_parallel_size,
                pipeline_parallel_size=args.pipeline_parallel_size,
                distributed_executor_backend=args.distributed_executor_backend,
                enforce_eager=args.enforce_eager, quantization=args.quantization,
                num_threads=args.num_threads, num_prefill_threads=args.num_prefill_threads,
                single_weight_copy=args.single_weight_copy,
                enable_lora=args.enable_lora or bool(args.lora_modules), max_loras=args.max_loras,
                max_lora_rank=args.max_lora_rank, pooler_config=getattr(args, "pooler_config", None))


def engine_config_from_args(args: argparse.Namespace):
    """EngineConfig from add_engine_args' flags (the services' counterpart of LLM(...))."""
    return make_engine_config(**engine_kwargs(args))
