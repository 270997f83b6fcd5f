"""The OpenAI-compatible server on loopback: concurrency, batching,
equality with direct calls, errors, API key, and our clients against it."""

import importlib.util
import json
import os
import urllib.error
import urllib.request

import numpy as np
import pytest

from cmimem_jax.encoders import make_encoder
from cmimem_jax.client import EndpointConfig, OpenAIClient
from cmimem_jax.serving import Server

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def serve_config():
  spec = importlib.util.spec_from_file_location(
      "serve_cpu", os.path.join(ROOT, "configs", "serve_cpu.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  # A random tiny policy and the hashing encoder keep the test fast.
  config.policy.update({"source": "random", "preset": "tiny"})
  config.encoder.update({"kind": "hashing", "dim": 32})
  config.serve.update({"max_new_tokens": 8, "buckets": (64, 128),
                       "max_prompt_tokens": 128, "batch_wait_ms": 50.0})
  return config


@pytest.fixture(scope="module")
def server():
  with Server(serve_config()) as running:
    yield running


def post(url, body, key=None, raw=None):
  request = urllib.request.Request(
      url, data=raw if raw is not None else json.dumps(body).encode(),
      headers={"Content-Type": "application/json",
               **({"Authorization": f"Bearer {key}"} if key else {})})
  try:
    with urllib.request.urlopen(request, timeout=120) as response:
      return response.status, json.loads(response.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def messages(i):
  return [{"role": "user", "content": f"Question number {i}: where?"}]


def test_64_concurrent_chats_all_answered_batched_and_equal_direct(server):
  client = OpenAIClient(EndpointConfig(base_url=server.base_url, model="m",
                                       concurrency=64, timeout_s=300,
                                       max_tokens=8, max_retries=0))
  results = client.chat_many([messages(i % 16) for i in range(64)])
  assert all(r.ok for r in results), [r.error for r in results if not r.ok]
  assert client.failures.as_dict()["failed_calls"] == {}
  assert sum(server.batcher.batches) >= 64
  assert max(server.batcher.batches) > 1  # Requests really were batched.
  # Greedy decoding: the same prompt gives the same text in any batch, and
  # the same as a direct call on the policy.
  texts = [r.text for r in results]
  assert all(texts[i] == texts[i % 16] for i in range(64))
  direct = server.batcher.policy.respond([messages(3)], 8)[0]
  assert texts[3] == direct


def test_embeddings_equal_direct_encoder_and_openai_encoder(server):
  status, body = post(server.base_url + "/embeddings",
                      {"model": "m", "input": ["a cat", "a dog"]})
  assert status == 200
  direct = server.encoder.encode(["a cat", "a dog"])
  np.testing.assert_allclose([d["embedding"] for d in body["data"]], direct,
                             atol=1e-6)
  remote = make_encoder(_remote_encoder_section(server.base_url))
  np.testing.assert_allclose(remote.encode(["a cat", "a dog"]), direct,
                             atol=1e-6)


def _remote_encoder_section(url):
  import ml_collections
  return ml_collections.ConfigDict({
      "kind": "openai", "dim": 32, "path": "", "query_prefix": "",
      "endpoint": {"base_url": url, "model": "m", "timeout_s": 30.0}})


@pytest.mark.parametrize("body,fragment", [
    ({"model": "m"}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
    ({"messages": messages(0), "temperature": 9}, "'temperature'"),
    ({"messages": messages(0), "max_tokens": 100000}, "'max_tokens'"),
    ({"messages": [{"role": "user", "content": "word " * 400}]},
     "exceeds rollout.max_prompt_tokens"),
])
def test_bad_chat_requests_get_400_with_a_message(server, body, fragment):
  status, reply = post(server.base_url + "/chat/completions", body)
  assert status == 400 and fragment in reply["error"]["message"]


def test_malformed_json_unknown_route_and_bad_embedding_input(server):
  status, reply = post(server.base_url + "/chat/completions", None,
                       raw=b"{oops")
  assert status == 400 and "invalid JSON" in reply["error"]["message"]
  status, _ = post(server.base_url + "/nowhere", {})
  assert status == 404
  status, reply = post(server.base_url + "/embeddings", {"input": [1, 2]})
  assert status == 400 and "'input'" in reply["error"]["message"]


def test_api_key_is_enforced(monkeypatch):
  monkeypatch.setenv("CMIMEM_TEST_KEY", "s3cret")
  config = serve_config()
  config.serve.update({"api_key_env": "CMIMEM_TEST_KEY", "chat": False})
  with Server(config) as server:
    url = server.base_url + "/embeddings"
    assert post(url, {"input": "x"})[0] == 401
    assert post(url, {"input": "x"}, key="wrong")[0] == 401
    assert post(url, {"input": "x"}, key="s3cret")[0] == 200
    assert server.httpd.server_address[0] == "127.0.0.1"
