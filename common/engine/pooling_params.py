"""Per-request embedding parameters (vLLM's PoolingParams for the embed task). Plain Python.

An embedding request runs its prompt through the model like a prefill and samples
nothing: the engine takes the final hidden state (after the last norm) at the prompt's
last token, the pooling of decoder embedding models (Qwen3-Embedding, e5-mistral,
gte-Qwen2), and `pool` turns it into the embedding. Only the last token's state is
needed, so a prompt whose head is in the prefix cache computes only its tail, as a
generation request does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# An embedding's values cross the wire as floats; a vector this long is larger than any
# hidden size served today (8,192 for 70B-class models, 16,384 for the largest).
MAX_EMBEDDING_DIMENSIONS = 65_536


@dataclass(frozen=True)
class PoolingParams:
    # L2-normalize the vector (vLLM's default for embeddings); False: the raw hidden state.
    normalize: bool = True
    # Matryoshka models: keep the first `dimensions` values (before normalizing);
    # None: the whole hidden state. Other models refuse it (check_for_model).
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}")
        dims = self.dimensions
        if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool)
                                 or not 1 <= dims <= MAX_EMBEDDING_DIMENSIONS):
            raise ValueError(f"dimensions must be an integer from 1 to {MAX_EMBEDDING_DIMENSIONS}, got {dims!r}")

    def check_for_model(self, hidden_size: int, is_matryoshka: bool,
                        matryoshka_dimensions: tuple[int, ...] | None) -> None:
        """ValueError where the model cannot give `dimensions` (vLLM's rules): only a
        Matryoshka model (config.json `is_matryoshka` or `matryoshka_dimensions`) cuts its
        vectors, to one of its listed sizes where it lists them, never past hidden_size."""
        dims = self.dimensions
        if dims is None:
            return
        if not is_matryoshka:
            raise ValueError(f"dimensions: this model does not support Matryoshka representation, so its "
                             f"embeddings have {hidden_size} values; leave dimensions out")
        if matryoshka_dimensions and dims not in matryoshka_dimensions:
            raise ValueError(f"dimensions: this model supports only {sorted(matryoshka_dimensions)}, got {dims}")
        if dims > hidden_size:
            raise ValueError(f"dimensions: at most the model's hidden size of {hidden_size}, got {dims}")

    def pool(self, hidden_state: list[float]) -> list[float]:
        """The embedding of one prompt from its last token's final hidden state."""
        values = hidden_state if self.dimensions is None else hidden_state[:self.dimensions]
        if not self.normalize:
            return list(values)
        # As torch's F.normalize: the norm floored at 1e-12, so a zero vector stays zero.
        norm = max(math.sqrt(math.fsum(v * v for v in values)), 1e-12)
        return [v / norm for v in values]
