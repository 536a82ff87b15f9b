"""Structured outputs (guided decoding): constraints, their grammars and token masks."""
from common.engine.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
