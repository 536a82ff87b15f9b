"""The gRPC API: stubs build from a fresh tree, every declaration is commented,
converters round-trip, every server can add health and reflection."""
from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import protos
from common.engine.outputs import Logprobs
from common.engine.sampling_params import SamplingParams
from common.service.common_api import logprobs_from_pb, logprobs_to_pb, sampling_params_from_pb, sampling_params_to_pb
from gateway.client import build_generate_request
from protos._build import SRC_DIR, build, is_fresh, proto_files
from protos.pdserve.v1 import (common_pb2, decode_pb2, embedding_pb2, generate_pb2, lora_adapters_pb2, prefill_pb2,
                               registry_pb2)
from protos.serving import GENERATE_SERVICE, add_health_and_reflection

MODULES = {"common": common_pb2, "generate": generate_pb2, "prefill": prefill_pb2,
           "decode": decode_pb2, "registry": registry_pb2, "embedding": embedding_pb2,
           "lora_adapters": lora_adapters_pb2}


def test_sources_are_versioned_and_complete():
    assert {p.stem for p in proto_files()} == set(MODULES)
    for path in proto_files():
        assert re.search(r"^package pdserve\.v1;$", path.read_text(), re.MULTILINE), path
        assert MODULES[path.stem].DESCRIPTOR.name == f"pdserve/v1/{path.name}"


def test_build_is_idempotent_and_fresh():
    out = build(force=True)
    assert is_fresh() and (out / "generate_pb2_grpc.py").exists()
    assert "from protos.pdserve.v1 import common_pb2" in (out / "generate_pb2.py").read_text()


def test_fresh_clone_generates_stubs_on_import(tmp_path):
    source = Path(protos.__file__).parent
    shutil.copytree(source, tmp_path / "protos", ignore=lambda folder, names: [
        n for n in names if n == "__pycache__" or (Path(folder) == source and n == "pdserve")])
    assert not (tmp_path / "protos" / "pdserve").exists()
    code = ("from protos.pdserve.v1 import generate_pb2, generate_pb2_grpc\n"
            "print(generate_pb2_grpc.GenerateServiceStub.__name__)")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "GenerateServiceStub"
    assert (tmp_path / "protos" / "pdserve" / "v1" / "decode_pb2.py").exists()


def test_installed_copy_without_sources_uses_its_stubs(tmp_path):
    """A non-editable install ships the generated stubs but not protos/src: importing
    must use them as they are, never try (and fail) to rebuild them."""
    source = Path(protos.__file__).parent
    shutil.copytree(source, tmp_path / "protos", ignore=lambda folder, names: [
        n for n in names if n in ("__pycache__", ".stamp", ".lock") or (Path(folder) == source and n == "src")])
    code = ("from protos.pdserve.v1 import generate_pb2_grpc\n"
            "print(generate_pb2_grpc.GenerateServiceStub.__name__)")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "GenerateServiceStub"
    assert not (tmp_path / "protos" / "pdserve" / ".stamp").exists()  # nothing was rebuilt
    # Neither sources nor stubs: a clear error, not protoc's.
    shutil.rmtree(tmp_path / "protos" / "pdserve")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0 and "no .proto sources" in result.stderr, result.stderr


_DECLARATION = re.compile(
    r"^\s*(?:(?P<field>(?:optional |repeated )?[\w.<>, ]+ (?P<fname>\w+) = \d+;)"
    r"|(?P<value>[A-Z][A-Z0-9_]* = \d+;)"
    r"|(?P<block>(?:message|enum|service|oneof) \w+ \{)"
    r"|(?P<rpc>rpc \w+\())")


def _declarations(path: Path):
    """(line, commented?, field name or None) for every declaration in a .proto."""
    previous = ""
    for line in path.read_text().splitlines():
        match = _DECLARATION.match(line)
        if match:
            commented = previous.strip().startswith("//") or "//" in line
            yield line.strip(), commented, match.group("fname")
        if line.strip():
            previous = line


def test_every_declaration_has_a_comment():
    uncommented = [f"{p.name}: {line}" for p in proto_files() for line, ok, _ in _declarations(p) if not ok]
    assert not uncommented, "\n".join(uncommented)


def test_comment_check_sees_every_field():
    # Guards the parser above: it must find exactly the fields protoc compiled.
    for path in proto_files():
        parsed = {name for _, _, name in _declarations(path) if name}
        compiled = {f.name for m in MODULES[path.stem].DESCRIPTOR.message_types_by_name.values()
                    for f in m.fields}
        assert parsed == compiled, path.name


def test_sampling_params_proto_mirrors_dataclass():
    import dataclasses
    # One rename: the engine keeps vLLM's `structured_outputs`, the API says `structured_output`.
    assert ({f.name for f in dataclasses.fields(SamplingParams)} - {"structured_outputs"} | {"structured_output"}
            == set(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name))


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
                   presence_penalty=0.5, frequency_penalty=-0.25, seed=2**40, stop=["\n\n", "END"],
                   stop_token_ids=[2, 7], include_stop_str_in_output=True, ignore_eos=True,
                   max_tokens=None, min_tokens=3, logprobs=0, skip_special_tokens=False),
    SamplingParams(temperature=0.0, max_tokens=1, logprobs=5),
    SamplingParams(structured_outputs={"json": {"type": "object", "properties": {"b": {}, "a": {}}}}),
    SamplingParams(structured_outputs={"json_object": True}),
    SamplingParams(structured_outputs={"regex": "[0-9]+"}),
    SamplingParams(structured_outputs={"choice": ["yes", "no"]}),
    SamplingParams(structured_outputs={"grammar": 'root ::= "a"'}),
    SamplingParams(structured_outputs={"regex": "[0-9]+", "start_after_token_ids": [1, 49152 - 1]}),
])
def test_sampling_params_round_trip(params):
    assert sampling_params_from_pb(sampling_params_to_pb(params)) == params
    wire = sampling_params_to_pb(params).SerializeToString()
    assert sampling_params_from_pb(common_pb2.SamplingParams.FromString(wire)) == params


def test_unset_sampling_fields_take_dataclass_defaults():
    assert sampling_params_from_pb(common_pb2.SamplingParams()) == SamplingParams()
    assert sampling_params_from_pb(common_pb2.SamplingParams(max_tokens=0)).max_tokens is None
    assert sampling_params_from_pb(common_pb2.SamplingParams(temperature=0.0)).temperature == 0.0


def test_logprobs_round_trip():
    logprobs = Logprobs(token_logprob=-0.5, top_token_ids=[3, 9], top_logprobs=[-0.5, -1.5])
    assert logprobs_from_pb(logprobs_to_pb(3, logprobs)) == (3, logprobs)


def test_generate_request_prompt_forms():
    assert build_generate_request("hi").WhichOneof("prompt") == "text"
    assert list(build_generate_request([1, 2, 3]).token_ids.ids) == [1, 2, 3]
    chat = build_generate_request([{"role": "user", "content": "hi"}], request_id="r1", priority=-1,
                                  return_token_ids=True)
    assert chat.messages.messages[0].content == "hi"
    assert (chat.request_id, chat.priority, chat.output.return_token_ids) == ("r1", -1, True)


def test_health_and_reflection_are_served():
    async def scenario():
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        await add_health_and_reflection(server, GENERATE_SERVICE)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                for service in ("", GENERATE_SERVICE):
                    reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
                services = {s.name async for reply in call for s in reply.list_services_response.service}
                assert GENERATE_SERVICE in services and "grpc.health.v1.Health" in services
        finally:
            await server.stop(None)
    asyncio.run(scenario())


def test_sources_are_outside_the_ignored_build_output():
    assert SRC_DIR.name == "src" and "pdserve" not in SRC_DIR.parts[:-1]


@pytest.mark.parametrize("constraint, message", [
    (common_pb2.StructuredOutput(), "sampling.structured_output must set one of json"),
    (common_pb2.StructuredOutput(json="{"), "sampling.structured_output.json is not valid JSON"),
    (common_pb2.StructuredOutput(regex="a("), "sampling.structured_output.regex is not a valid regular expression"),
    (common_pb2.StructuredOutput(choice=common_pb2.StringList()), "sampling.structured_output.choice must be a list"),
    (common_pb2.StructuredOutput(json_object=False), "sampling.structured_output.json_object must be true"),
    (common_pb2.StructuredOutput(regex="a", start_after_token_ids=[1] * 65),
     "sampling.structured_output.start_after_token_ids must be a list of at most 64"),
])
def test_bad_structured_output_is_invalid_argument_naming_the_field(constraint, message):
    from common.service.errors import ServiceError
    msg = common_pb2.SamplingParams(structured_output=constraint)
    with pytest.raises(ServiceError) as info:
        sampling_params_from_pb(msg, field_path="sampling.")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in info.value.message
