"""KV-cache sampling for rollouts and inference."""

from cmimem_jax.sampling.sampler import (SampleOutput, Sampler, SamplingConfig,
                                         bucket_length, left_pad, sample_token)

__all__ = ["SampleOutput", "Sampler", "SamplingConfig", "bucket_length",
           "left_pad", "sample_token"]
