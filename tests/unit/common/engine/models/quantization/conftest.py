"""The bundled GGUF's raw blocks, read once per session, and gguf's own reader of the
same file: the reference the tests hold ours to."""
from __future__ import annotations

import pytest

from common.engine.model_files import bundled_gguf_path
from common.engine.models.quantization.gguf_blocks import GGUFQuantizedWeights


@pytest.fixture(scope="session")
def bundled_gguf() -> GGUFQuantizedWeights:
    return GGUFQuantizedWeights(bundled_gguf_path())


@pytest.fixture(scope="session")
def gguf_reader():
    """gguf.GGUFReader of the bundled file (it parses every metadata item: seconds)."""
    from gguf import GGUFReader
    return GGUFReader(str(bundled_gguf_path()))


@pytest.fixture(scope="session")
def reference_tensors(gguf_reader) -> dict:
    """name -> gguf's ReaderTensor."""
    return {t.name: t for t in gguf_reader.tensors}
