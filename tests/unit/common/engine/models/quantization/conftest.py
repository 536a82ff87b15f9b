"""The bundled GGUF's raw blocks, read once per session."""
from __future__ import annotations

import pytest

from common.engine.model_files import bundled_gguf_path
from common.engine.models.quantization.gguf_blocks import GGUFQuantizedWeights


@pytest.fixture(scope="session")
def bundled_gguf() -> GGUFQuantizedWeights:
    return GGUFQuantizedWeights(bundled_gguf_path())
