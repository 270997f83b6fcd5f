"""Generation engines behind one interface (`GenerationEngine`): the JAX
KV-cache `Sampler` (default; optionally grammar-constrained by a
`TokenConstraint`) and `VLLMEngine` (GPU fallback, optional import), and
`ChatPolicy`, the chat-template wrapper that the training
loop, evaluation and the server generate through."""

from cmimem_jax.sampling.constraint import TokenConstraint
from cmimem_jax.sampling.engine import EngineHooks, GenerationEngine
from cmimem_jax.sampling.policy import (ChatPolicy, PolicyConfig,
                                        check_vocabulary,
                                        checkpoint_tokenizer_path,
                                        encode_chat, load_policy,
                                        load_policy_and_tokenizer,
                                        load_tokenizer, policy_tokenizer_path,
                                        special_ids, token_budget)
from cmimem_jax.sampling.sampler import (SampleOutput, Sampler, SamplingConfig,
                                         bucket_length, left_pad, sample_token)

__all__ = ["ChatPolicy", "PolicyConfig", "EngineHooks", "GenerationEngine",
           "SampleOutput", "Sampler",
           "SamplingConfig", "bucket_length", "check_vocabulary",
           "checkpoint_tokenizer_path", "encode_chat", "left_pad",
           "load_policy", "load_policy_and_tokenizer", "load_tokenizer",
           "policy_tokenizer_path", "sample_token", "special_ids",
           "token_budget", "TokenConstraint"]
