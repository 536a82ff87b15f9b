"""LoRA adapters served beside the base model (vLLM's multi-LoRA): a request names an
adapter (LoRARequest), the runner holds the adapters in use (manager.py) and adds each
one's low-rank delta to the rows of its requests in every wrapped linear (layers.py); the
adapter files are PEFT's (adapter.py). Prefix-cache blocks are shared only by requests of
the same adapter (block_hash.root_parent_hash)."""
