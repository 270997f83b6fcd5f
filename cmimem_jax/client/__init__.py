"""OpenAI-compatible endpoints: the chat/embedding client with retries and
failure accounting, and the `ChatModel` interface it shares with our Flax
policy. The lowest layer that talks to models over HTTP: encoders,
evaluation and training all use it."""

from cmimem_jax.client.openai_compatible import (CallResult, ChatModel,
                                                 EndpointConfig, FailureLog,
                                                 MalformedResponse, Messages,
                                                 OpenAIClient, PromptFits,
                                                 classify_error, submit_chats,
                                                 then)

__all__ = ["CallResult", "ChatModel", "EndpointConfig", "FailureLog",
           "MalformedResponse", "Messages", "OpenAIClient", "PromptFits",
           "classify_error", "submit_chats", "then"]
