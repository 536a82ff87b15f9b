"""Finding and converting models: the GGUF conversion's shared parsing."""
from __future__ import annotations

import threading

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


def test_overlapping_conversions_in_one_process_take_turns_and_restore_gguf():
    reader_class = gguf.GGUFReader
    inside, second_entered, order = threading.Event(), threading.Event(), []

    def second():
        inside.wait(5)
        with model_files._gguf_parsed_once():
            order.append("second")
            second_entered.set()

    thread = threading.Thread(target=second)
    thread.start()
    with model_files._gguf_parsed_once():
        inside.set()
        assert not second_entered.wait(0.2)  # it waits for this block to end
        order.append("first")
    thread.join(5)
    assert order == ["first", "second"]
    assert gguf.GGUFReader is reader_class
