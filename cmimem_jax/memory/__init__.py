"""The four-slot memory system: state, Apply, DSL/JSON formats, prompts, retrieval."""

from cmimem_jax.memory.apply import (ApplyReport, CoreConfig, MemoryEditors,
                                     apply_operations, apply_response,
                                     keep_recent_lines)
from cmimem_jax.memory.bank import MemoryBank, SearchHit, TypedStore
from cmimem_jax.memory.dsl import LineError, ParsedResponse, clean_field, parse, render
from cmimem_jax.memory.prompt_builder import PolicyPrompter
from cmimem_jax.memory.json_agents import (combine_agent_outputs, loads_llm_json,
                                           parse_agent_output)
from cmimem_jax.memory.retrieval import (Chunk, MemoryStore, lookup_chunks,
                                         retrieve, retrieve_per_type)
from cmimem_jax.memory.types import (ALLOWED_ACTIONS, ENTRY_TYPES, Action,
                                     MemoryEntry, MemoryType, Operation,
                                     validate_operation)

__all__ = [
    "ALLOWED_ACTIONS", "ENTRY_TYPES", "Action", "ApplyReport", "Chunk",
    "CoreConfig", "LineError", "MemoryBank", "MemoryEditors", "MemoryEntry",
    "MemoryStore", "MemoryType", "Operation", "ParsedResponse",
    "PolicyPrompter", "SearchHit", "TypedStore",
    "apply_operations", "apply_response", "clean_field",
    "combine_agent_outputs", "keep_recent_lines", "loads_llm_json",
    "lookup_chunks", "parse", "parse_agent_output", "render", "retrieve",
    "retrieve_per_type", "validate_operation",
]
