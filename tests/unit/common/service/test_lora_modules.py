"""--lora-modules NAME=PATH: what an instance serves, and what a request naming an adapter
runs with (INVALID_ARGUMENT for one it does not serve)."""
from __future__ import annotations

import argparse

import grpc
import pytest

from common.engine.engine_args import add_engine_args, engine_config_from_args
from common.engine.lora.request import LoRARequest
from common.service.errors import ServiceError
from common.service.lora_modules import LoRAModules


def test_modules_are_parsed_in_order_with_ids_from_one():
    modules = LoRAModules.parse(["sql=/a/sql", "chat=/b/chat=x"])
    assert modules.names == ["sql", "chat"]
    assert modules.resolve("chat") == LoRARequest("chat", 2, "/b/chat=x") and modules.resolve(None) is None
    with pytest.raises(ServiceError) as error:
        modules.resolve("other")
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and "serves: sql, chat" in error.value.message
    for bad, message in ((["sql"], "NAME=PATH"), (["=p"], "NAME=PATH"), (["a=p", "a=q"], "twice")):
        with pytest.raises(ValueError, match=message):
            LoRAModules.parse(bad)


def test_the_flags_enable_lora_and_repeat():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--lora-modules", "a=/p", "b=/q", "--lora-modules", "c=/r", "--max-loras", "2"])
    assert args.lora_modules == ["a=/p", "b=/q", "c=/r"]
    config = engine_config_from_args(args)
    assert config.lora.enable_lora and config.lora.max_loras == 2
    assert not engine_config_from_args(parser.parse_args([])).lora.enable_lora


def test_run_time_changes_take_fresh_ids_and_bump_the_version():
    modules = LoRAModules.parse(["sql=/a/sql"])
    assert modules.version == 0
    chat = modules.new_request("chat", "/b/chat")
    assert chat == LoRARequest("chat", 2, "/b/chat") and "chat" not in modules  # served once added
    modules.add(chat)
    modules.add(modules.new_request("sql", "/c/sql"))  # in place: a fresh id, the same name
    assert modules.names == ["sql", "chat"] and modules.resolve("sql") == LoRARequest("sql", 3, "/c/sql")
    # Those loaded at run time are reported with their paths (the gateways give them to
    # instances joining later); --lora-modules' own are not, until replaced at run time.
    assert modules.runtime_paths == {"sql": "/c/sql", "chat": "/b/chat"}
    assert LoRAModules.parse(["sql=/a/sql"]).runtime_paths == {}
    modules.remove("chat")
    assert modules.names == ["sql"] and modules.version == 3 and modules.runtime_paths == {"sql": "/c/sql"}
    with pytest.raises(ServiceError):
        modules.resolve("chat")
