"""Configuration objects shared by the engine, the services and the CLI.

`ModelConfig` describes the network (read from a Hugging Face config.json);
`CacheConfig` and `SchedulerConfig` describe how the engine runs it.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from common.engine.json_options import json_object_option
from common.engine.models.registry import MODEL_TYPES, check_architecture
from common.engine.pooling_params import parse_pooler_config


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only model, for every family in common.engine.models.registry."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 has biases on q/k/v projections
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"
    rotary_dim: int | None = None  # None: the whole head (Phi-4-mini rotates 3/4 of it)
    # Per layer: how many past positions a query sees (None: all of them).
    layer_sliding_windows: tuple[int | None, ...] = ()
    attn_logit_softcapping: float | None = None  # Gemma 2
    final_logit_softcapping: float | None = None  # Gemma 2
    query_pre_attn_scalar: float | None = None  # Gemma 2: scores scale by its -1/2, not head_dim's
    # Embeddings (PoolingParams.dimensions): whether the model's vectors may be cut to their
    # first values, and to which sizes (None: any up to hidden_size).
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def sliding_window(self, layer_idx: int) -> int | None:
        return self.layer_sliding_windows[layer_idx] if self.layer_sliding_windows else None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else MODEL_TYPES.get(cfg.get("model_type", ""), cfg.get("model_type") or "")
        check_architecture(arch)
        num_heads = cfg["num_attention_heads"]
        # transformers >= 5 moves rope settings into `rope_parameters`.
        rope = cfg.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        if rope_scaling is not None and "original_max_position_embeddings" in cfg:
            # Phi-3 keeps it beside rope_scaling rather than inside.
            rope_scaling = {"original_max_position_embeddings": cfg["original_max_position_embeddings"],
                            **rope_scaling}
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        partial_rotary = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            rotary_dim=int(head_dim * partial_rotary) if partial_rotary != 1.0 else None,
            layer_sliding_windows=_layer_sliding_windows(cfg),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            is_matryoshka=bool(cfg.get("is_matryoshka") or cfg.get("matryoshka_dimensions")),
            matryoshka_dimensions=(tuple(cfg["matryoshka_dimensions"]) if cfg.get("matryoshka_dimensions")
                                   else None),
        )

    def num_params(self) -> int:
        h, i, l = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return l * per_layer + emb + h

    def kv_bytes_per_token(self, dtype_size: int, num_layers: int | None = None,
                           num_kv_heads: int | None = None) -> int:
        """Bytes of K and V that one token occupies across all layers (or num_layers layers
        of num_kv_heads heads each: one rank's share under tensor/pipeline parallelism)."""
        num_layers = self.num_hidden_layers if num_layers is None else num_layers
        num_kv_heads = self.num_key_value_heads if num_kv_heads is None else num_kv_heads
        return 2 * num_layers * num_kv_heads * self.head_dim * dtype_size

    def verify_parallel(self, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        """Raise, naming the counts, where this model cannot be split this way (vLLM's rules:
        query heads and MLP columns split evenly; KV heads split evenly, or, with more ranks
        than KV heads, each KV head replicated on an equal number of ranks)."""
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        num_heads, num_kv_heads = self.num_attention_heads, self.num_key_value_heads
        if num_heads % tp:
            raise ValueError(f"Total number of attention heads ({num_heads}) must be divisible by tensor "
                             f"parallel size ({tp}).")
        if tp >= num_kv_heads and tp % num_kv_heads:
            raise ValueError(f"Tensor parallel size ({tp}) must be a multiple of the total number of key/value "
                             f"heads ({num_kv_heads}) when it is larger, so each KV head is replicated on "
                             f"an equal number of ranks.")
        if tp < num_kv_heads and num_kv_heads % tp:
            raise ValueError(f"Total number of key/value heads ({num_kv_heads}) must be divisible by tensor "
                             f"parallel size ({tp}).")
        if self.intermediate_size % tp:
            raise ValueError(f"Intermediate size ({self.intermediate_size}) must be divisible by tensor "
                             f"parallel size ({tp}).")
        if self.num_hidden_layers < pp:
            raise ValueError(f"Total number of hidden layers ({self.num_hidden_layers}) must be at least the "
                             f"pipeline parallel size ({pp}).")


def _layer_sliding_windows(cfg: dict[str, Any]) -> tuple[int | None, ...]:
    """The sliding window of each layer, as transformers applies it."""
    num_layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    # Qwen2/3 configs carry a window they only use when use_sliding_window is set.
    if window is None or cfg.get("use_sliding_window") is False:
        return (None,) * num_layers
    layer_types = cfg.get("layer_types")
    if layer_types:  # Gemma 2 alternates sliding and full layers
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (window,) * num_layers  # Mistral, Phi-3: every layer


KV_CACHE_DTYPE_NAMES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass
class CacheConfig:
    block_size: int = 16
    # Bytes (int) or a fraction (0 < x <= 1) of free device memory after weights.
    kv_cache_memory: float | int | None = None
    num_blocks: int | None = None  # set once the KV pool is sized (or forced by tests)
    enable_prefix_caching: bool = True
    # What the pool holds: "auto" the model's dtype; "fp8" (= "fp8_e4m3") or "fp8_e5m2" 8-bit
    # float codes (CPU; common.engine.device.select_kv_cache_dtype).
    cache_dtype: str = "auto"
    # Blocks a request takes past what it needs now when it needs more, while the pool has
    # more than half its blocks empty, and at most what its max_tokens can fill: a request's
    # KV then grows in runs of that many + 1 consecutive blocks, which a step's attention
    # reads as streams (one block at a time, the running requests' blocks interleave).
    num_blocks_ahead: int = 7

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks_ahead, int) or self.num_blocks_ahead < 0:
            raise ValueError(f"num_blocks_ahead must be an integer >= 0, got {self.num_blocks_ahead!r}")
        if self.cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_NAMES)}; "
                             f"got {self.cache_dtype!r}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    # Decode steps one scheduling may run back to back (vLLM's --num-scheduler-steps): where
    # every running request decodes greedily and nobody waits, the runner takes up to this
    # many tokens per request from one step, each the next one's input, and the scheduler's
    # and engine's work is paid once for them. Tokens reach callers in bursts of that many.
    num_scheduler_steps: int = 1
    # A prompt chunk takes at most this many tokens of a step (vLLM's --long-prefill-token-threshold),
    # so a long prompt shares each step's budget with shorter prompts and keeps steps short for the
    # running decodes: their tokens and short prompts' first tokens wait less, long prompts' more.
    # 0: a chunk takes what budget is left.
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.num_scheduler_steps, int) or self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be an integer >= 1; got {self.num_scheduler_steps!r}")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0; "
                             f"got {self.long_prefill_token_threshold!r}")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold cuts prompts into chunks: it needs chunked prefill "
                             "(drop --no-chunked-prefill, or the threshold)")


@dataclass
class KVTransferConfig:
    """How this engine moves KV to or from other engines (disaggregated prefill/decode).

    role "producer" ships each finished prompt's KV to the target its request names
    (the prefill service); "consumer" receives prompts' KV into blocks it reserved
    (the decode service); "none" runs colocated.
    """

    role: str = "none"  # "producer" | "consumer" | "none"
    backend: str = "zmq"  # "zmq" | "gloo" | "nccl" (torch.distributed)
    # Consumer: where the receiver listens; tcp://HOST:PORT or ipc:// for zmq, HOST:PORT
    # (or gloo://HOST:PORT) for torch.distributed; port 0 or * picks a free one.
    bind_endpoint: str = "tcp://127.0.0.1:*"
    # Producer: send each layer as soon as the forward pass wrote it, overlapping the
    # rest of the pass, instead of every layer after the pass.
    layerwise_send: bool = True

    def __post_init__(self) -> None:
        if self.role not in ("producer", "consumer", "none"):
            raise ValueError(f"kv_transfer role must be producer, consumer or none; got {self.role!r}")
        if self.backend not in ("zmq", "gloo", "nccl"):
            raise ValueError(f"kv_transfer backend must be zmq, gloo or nccl; got {self.backend!r}")


SPECULATIVE_METHODS = ("ngram", "early_exit", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's --speculative-config): a proposer drafts tokens that
    the target verifies in the next step, as extra tokens of that step.

    Speculation is turned off for a step when more than `disable_by_batch_size` requests
    run (verifying k + 1 tokens per row is not free on a CPU), except for the requests
    whose drafts have been holding: an acceptance rate of `large_batch_min_acceptance_rate`
    or more (None: no exception); and for a request whose recent acceptance rate fell
    below `min_acceptance_rate`: it then skips `num_backoff_steps` steps before it drafts
    again.
    """

    method: str = "ngram"  # "ngram" | "early_exit" | "draft_model"
    num_speculative_tokens: int = 3  # k: drafts per request per step
    prompt_lookup_min: int = 2  # ngram: shortest suffix to look up
    prompt_lookup_max: int = 4  # ngram: longest suffix to look up
    num_early_exit_layers: int | None = None  # early_exit: target layers the draft runs (default 1/4)
    draft_model: str | None = None  # draft_model: a model sharing the target's tokenizer
    disable_by_batch_size: int | None = 4  # None: never off for batch size
    large_batch_min_acceptance_rate: float | None = 0.8  # past disable_by_batch_size, who still drafts
    min_acceptance_rate: float = 0.2
    num_backoff_steps: int = 8

    @property
    def drafts_with_target_layers(self) -> bool:
        """The draft is the target's own first layers (early_exit): under tensor parallelism
        every rank runs the draft passes through its share of them."""
        return self.method == "early_exit"

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}; "
                             f"got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in 1..16; got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max; got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.draft_model:
            raise ValueError("speculative method draft_model needs draft_model (a model path or GGUF)")
        if self.num_early_exit_layers is not None and self.num_early_exit_layers < 1:
            raise ValueError(f"num_early_exit_layers must be >= 1; got {self.num_early_exit_layers}")
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise ValueError(f"min_acceptance_rate must be in [0, 1]; got {self.min_acceptance_rate}")
        rate = self.large_batch_min_acceptance_rate
        if rate is not None and not 0.0 <= rate <= 1.0:
            raise ValueError(f"large_batch_min_acceptance_rate must be in [0, 1] or null; got {rate}")

    @property
    def proposer_writes_kv(self) -> bool:
        """The proposer runs model layers over its drafts, so their slots must exist."""
        return self.method != "ngram"

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From LLM(speculative_config=...) or --speculative-config JSON."""
        if value is None or isinstance(value, cls):
            return value
        value = json_object_option(value, "speculative_config", (f.name for f in dataclasses.fields(cls)))
        import pydantic
        # Strict JSON types: "3" is no count and true no rate (a plain cls(**value) would
        # compare them with numbers and fail with a TypeError, or take true for 1.0).
        try:
            return pydantic.TypeAdapter(cls).validate_json(json.dumps(value, default=str), strict=True)
        except pydantic.ValidationError as e:
            problems = []
            for error in e.errors():
                field_name = ".".join(map(str, error["loc"]))  # empty for __post_init__'s own checks
                message = error["msg"].removeprefix("Value error, ")
                problems.append(f"{field_name}: {message}" if field_name else message)
            raise ValueError(f"speculative_config: {'; '.join(problems)}") from None


EXECUTOR_BACKENDS = ("uni", "mp")
QUANTIZATION_METHODS = ("gguf", "int8")


@dataclass
class ParallelConfig:
    """How the model is split over worker processes (vLLM's flags and names).

    Tensor parallelism splits each layer's heads and MLP columns over ranks; pipeline
    parallelism splits the layers into stages. `uni` runs one rank in this process;
    `mp` starts one worker process per rank.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: uni for one rank, mp for more

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}; "
                             f"got {backend!r}")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend uni runs one rank; tensor_parallel_size x "
                             f"pipeline_parallel_size is {self.world_size}: use mp")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        return self.distributed_executor_backend or ("uni" if self.world_size == 1 else "mp")

    def check_supports(self, kv_transfer: KVTransferConfig | None, speculative: SpeculativeConfig | None) -> None:
        """Raise, before anything loads, where what is asked cannot run split over these ranks.

        n-gram drafts need no model and a draft model runs whole on the output rank, which
        alone samples; early-exit drafts run the target's own first layers, which every TP rank
        runs with it, while under pipeline parallelism those layers sit on a stage that never
        sees the sampled tokens."""
        if self.world_size == 1:
            return
        if speculative is not None and speculative.drafts_with_target_layers and self.pipeline_parallel_size > 1:
            raise ValueError(f"speculative method {speculative.method} is not supported with pipeline parallelism "
                             f"(pipeline_parallel_size {self.pipeline_parallel_size}): its draft is the target's own "
                             f"first layers, on the first stage; use ngram or draft_model (the draft model runs "
                             f"whole on the rank that samples), or tensor parallelism")
        if kv_transfer is not None and kv_transfer.role != "none" and self.pipeline_parallel_size > 1:
            raise ValueError(f"KV transfer (role {kv_transfer.role}) is not supported with pipeline parallelism "
                             f"(pipeline_parallel_size {self.pipeline_parallel_size}); tensor parallelism is")


@dataclass
class LoRAConfig:
    """vLLM's --enable-lora, --max-loras, --max-lora-rank: adapters the runner holds at once
    (loaded on a request's first use, an unused one evicted for a new one) and their rank."""

    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1; got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1; got {self.max_lora_rank}")


@dataclass
class EngineConfig:
    """Everything an engine needs to start; built from CLI flags or `LLM(...)` kwargs."""

    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: bf16 on CUDA and native-bf16 CPUs, else fp32 (common.engine.device)
    device: str = "auto"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # True: run the model eagerly; False: compile it (torch.compile, inductor) where a
    # compiler is present.
    enforce_eager: bool = False
    # None: weights in `dtype`; "gguf": a GGUF checkpoint's own quantized blocks (Q4_1,
    # Q8_0) as stored; "int8": int8 weight-only, per output channel.
    quantization: str | None = None
    num_threads: int | None = None  # this process's torch threads; None: one per core, within its CPU quota
    # CPU: torch threads for the steps that prefill at least PREFILL_THREADS_MIN_TOKENS
    # prompt tokens (None: num_threads for every step). For a decode instance that prefills
    # beside the gateway's reserved core: while a long prefill step runs it streams no
    # tokens, so the gateway's core is free for that step's matmuls.
    num_prefill_threads: int | None = None
    # CPU, bf16 on AVX512-BF16 without AMX: each linear keeps its weight once (panel_gemm's
    # column panels, serving steps of every size) instead of adding oneDNN's packed copy for
    # steps past 128 tokens; for decode instances, which prefill only short prompts.
    # Elsewhere it changes nothing.
    single_weight_copy: bool = False
    # Embeddings: the PoolingConfig fields --pooler-config sets over the model's own
    # (pooling_params.parse_pooler_config's: pooling_type, normalize); None: the model's.
    pooler_config: dict | None = None

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; "
                             f"got {self.quantization!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1; got {self.num_threads}")
        if self.num_prefill_threads is not None and self.num_prefill_threads < 1:
            raise ValueError(f"num_prefill_threads must be >= 1; got {self.num_prefill_threads}")
        if self.num_prefill_threads is not None and self.parallel.world_size > 1:
            # Ranks run at once, each on its share of the cores: more threads in one would take another's.
            raise ValueError(f"num_prefill_threads is for one rank; this engine has "
                             f"{self.parallel.world_size} (tensor x pipeline parallel)")

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def make_engine_config(model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                       seed: int = 0, block_size: int = 16,
                       kv_cache_memory: str | float | int | None = None, num_kv_blocks: int | None = None,
                       max_model_len: int | None = None, max_num_seqs: int = 64,
                       max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                       enable_chunked_prefill: bool = True,
                       speculative_config: SpeculativeConfig | dict | str | None = None,
                       tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                       distributed_executor_backend: str | None = None, enforce_eager: bool = False,
                       quantization: str | None = None, num_threads: int | None = None,
                       num_prefill_threads: int | None = None, single_weight_copy: bool = False,
                       num_scheduler_steps: int = 1, kv_cache_dtype: str = "auto", enable_lora: bool = False,
                       max_loras: int = 4, max_lora_rank: int = 16,
                       pooler_config: dict | str | None = None,
                       long_prefill_token_threshold: int = 0, num_kv_blocks_ahead: int = 7) -> EngineConfig:
    """The one place flat engine options (LLM kwargs, CLI flags) become an EngineConfig."""
    return EngineConfig(
        model=model, dtype=dtype, device=device, seed=seed,
        cache=CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory, num_blocks=num_kv_blocks,
                          enable_prefix_caching=enable_prefix_caching, cache_dtype=kv_cache_dtype,
                          num_blocks_ahead=num_kv_blocks_ahead),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
                                  num_scheduler_steps=num_scheduler_steps,
                                  long_prefill_token_threshold=long_prefill_token_threshold),
        speculative=SpeculativeConfig.parse(speculative_config),
        parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                pipeline_parallel_size=pipeline_parallel_size,
                                distributed_executor_backend=distributed_executor_backend),
        lora=LoRAConfig(enable_lora=enable_lora, max_loras=max_loras, max_lora_rank=max_lora_rank),
        enforce_eager=enforce_eager, quantization=quantization, num_threads=num_threads,
        num_prefill_threads=num_prefill_threads, single_weight_copy=single_weight_copy,
        pooler_config=parse_pooler_config(pooler_config))


_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2,
               "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30}


def parse_memory_size(text: str | float | int) -> float | int:
    """'2GiB' / '512MiB' / '1073741824' -> bytes (int); '0.5' -> a fraction (float in (0, 1])."""
    if isinstance(text, (int, float)):
        value = text
    else:
        import re
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
        if not m or m.group(2).lower() not in _SIZE_UNITS:
            raise ValueError(f"kv_cache_memory must be bytes (e.g. 2GiB, 512MiB, 1073741824) or a "
                             f"fraction in (0, 1]; got {text!r}")
        number, unit = float(m.group(1)), m.group(2).lower()
        value = number if (unit == "" and number <= 1 and "." in m.group(1)) else int(number * _SIZE_UNITS[unit])
    if isinstance(value, float) and not 0 < value <= 1:
        raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1]; got {value}")
    if isinstance(value, int) and value <= 0:
        raise ValueError(f"kv_cache_memory must be positive; got {value}")
    return value
