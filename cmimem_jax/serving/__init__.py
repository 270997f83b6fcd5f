"""Serving our Flax policy and encoder over the OpenAI API (the local answer
model / judge, and the endpoint of `encoder.kind="openai"`): the ASGI app
(`app`), the request batcher (`batcher`), and the uvicorn server
(`server`)."""

from cmimem_jax.serving.app import (ChatRequest, Limits, RequestError,
                                    make_app, parse_chat_request)
from cmimem_jax.serving.batcher import ChatBatcher, Completion
from cmimem_jax.serving.server import (SERVE_SECTIONS, Server, ServeConfig,
                                       ServeRunConfig, api_key_from_env)

__all__ = ["ChatBatcher", "ChatRequest", "Completion", "Limits",
           "RequestError", "SERVE_SECTIONS", "ServeConfig", "ServeRunConfig",
           "Server", "api_key_from_env", "make_app", "parse_chat_request"]
