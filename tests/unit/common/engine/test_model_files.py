"""Finding and converting models: the GGUF conversion's shared parsing."""
from __future__ import annotations

import gguf
import numpy as np

from common.engine import model_files


def _write_gguf(path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_conversion_parses_each_file_once_and_restores_gguf(tmp_path):
    path = tmp_path / "m.gguf"
    _write_gguf(path)
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with model_files._gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # transformers opens it by str and by Path
        assert gguf.GGUFReader(path, "c") is not first
        assert [t.name for t in first.tensors] == ["token_embd.weight"]
        table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is table
        assert table.get_name("blk.1.attn_q") == name_map(gguf.MODEL_ARCH.LLAMA, 2).get_name("blk.1.attn_q")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)
