"""Serving our Flax policy and encoder over the OpenAI API (the local answer
model / judge, and the endpoint of `encoder.kind="openai"`)."""

from cmimem_jax.serving.server import (BackgroundServer, ChatBatcher,
                                       RequestError, Server,
                                       parse_chat_request)

__all__ = ["BackgroundServer", "ChatBatcher", "RequestError", "Server",
           "parse_chat_request"]
