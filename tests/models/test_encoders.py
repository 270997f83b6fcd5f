import numpy as np
import pytest
import torch
import transformers

from cmimem_jax.encoders import Encoder
from cmimem_jax.encoders.neural import (MiniLMEncoder, Qwen3EmbeddingEncoder,
                                        minilm_directory)
from cmimem_jax.models.bert import load_bert, mean_pool
from cmimem_jax.models.qwen3 import load_hf, positions_from_mask
from cmimem_jax.encoders.neural import last_token_pool
from cmimem_jax.testing.hf_models import left_padded_batch


def _random_bert(tmp_path):
  config = transformers.BertConfig(vocab_size=120, hidden_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=96,
                                   max_position_embeddings=64)
  torch.manual_seed(0)
  model = transformers.BertModel(config, add_pooling_layer=False).eval()
  model.save_pretrained(tmp_path / "bert", safe_serialization=True)
  return model, str(tmp_path / "bert")


def test_bert_mean_pooled_embeddings_match_transformers(tmp_path):
  hf, directory = _random_bert(tmp_path)
  ours = load_bert(directory)
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 120, (3, 10)).astype(np.int32)
  mask = np.ones((3, 10), np.int32)
  mask[1, 6:] = 0
  mask[2, 3:] = 0
  with torch.no_grad():
    hidden = hf(input_ids=torch.from_numpy(tokens).long(),
                attention_mask=torch.from_numpy(mask).long()).last_hidden_state
  m = torch.from_numpy(mask)[..., None].float()
  want = ((hidden * m).sum(1) / m.sum(1))
  want = torch.nn.functional.normalize(want, dim=-1).numpy()
  got = np.asarray(mean_pool(ours(tokens, mask), mask))
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_qwen3_embedding_last_token_matches_transformers(tmp_path):
  config = transformers.Qwen3Config(
      vocab_size=90, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
      rope_theta=1e6, max_position_embeddings=128)
  torch.manual_seed(1)
  hf = transformers.Qwen3Model(config).eval()
  hf.save_pretrained(tmp_path / "emb", safe_serialization=True)
  ours = load_hf(str(tmp_path / "emb"), lm_head=False)
  tokens, mask = left_padded_batch(90, [9, 4, 6], 9, seed=2)
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
  with torch.no_grad():
    hidden = hf(input_ids=torch.from_numpy(tokens).long(),
                attention_mask=torch.from_numpy(mask).long(),
                position_ids=torch.from_numpy(positions).long()
                ).last_hidden_state[:, -1]
  want = torch.nn.functional.normalize(hidden, dim=-1).numpy()
  got_hidden, _ = ours.hidden_states(tokens, positions_from_mask(mask), mask)
  got = np.asarray(last_token_pool(got_hidden, mask))
  np.testing.assert_allclose(got, want, atol=1e-5)
  # Right padding pools the same real token.
  right_tokens = np.zeros_like(tokens)
  right_mask = np.zeros_like(mask)
  for r in range(3):
    n = mask[r].sum()
    right_tokens[r, :n] = tokens[r, -n:]
    right_mask[r, :n] = 1
  right_hidden, _ = ours.hidden_states(right_tokens,
                                       positions_from_mask(right_mask),
                                       right_mask)
  np.testing.assert_allclose(last_token_pool(right_hidden, right_mask), want,
                             atol=1e-5)


def test_minilm_package_encoder_is_real_and_normalised():
  try:
    minilm_directory()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  encoder = MiniLMEncoder(batch_size=4)
  assert isinstance(encoder, Encoder) and encoder.dim == 384
  texts = ["I adopted a beagle named Rex.", "My dog Rex is a beagle.",
           "The stock market fell sharply today.", "", "x " * 400]
  vectors = encoder.encode(texts)
  assert vectors.shape == (5, 384) and vectors.dtype == np.float32
  np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
  assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2] + 0.3
  # Same text, same vector regardless of batch composition.
  np.testing.assert_allclose(encoder.encode([texts[2]])[0], vectors[2],
                             atol=1e-5)
  # Reference: sentence-transformers' recipe in transformers.
  tok = transformers.AutoTokenizer.from_pretrained(minilm_directory())
  hf = transformers.AutoModel.from_pretrained(minilm_directory()).eval()
  batch = tok(texts[:3], padding=True, return_tensors="pt")
  with torch.no_grad():
    hidden = hf(**batch).last_hidden_state
  m = batch["attention_mask"][..., None].float()
  want = torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)
  np.testing.assert_allclose(vectors[:3], want.numpy(), atol=1e-5)


def test_qwen3_embedding_encoder_batches_and_prefixes_queries(tmp_path):
  try:
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_directory())
  except FileNotFoundError as e:
    pytest.skip(str(e))
  config = transformers.Qwen3Config(
      vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=48,
      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
      head_dim=16, max_position_embeddings=512)
  torch.manual_seed(2)
  transformers.Qwen3Model(config).save_pretrained(tmp_path / "emb")
  tokenizer.save_pretrained(tmp_path / "emb")  # Any tokenizer will do here.
  encoder = Qwen3EmbeddingEncoder(str(tmp_path / "emb"), instruction="Find it",
                                  batch_size=2, max_length=64)
  texts = ["a beagle named Rex", "tea", "the stock market fell"]
  docs = encoder.encode(texts)
  queries = encoder.encode(texts, kind="query")
  assert docs.shape == (3, 32)
  np.testing.assert_allclose(np.linalg.norm(docs, axis=1), 1, atol=1e-5)
  assert not np.allclose(docs, queries)  # The instruction prefix is used.
  alone = encoder.encode(["Instruct: Find it\nQuery:tea"])
  np.testing.assert_allclose(queries[1], alone[0], atol=1e-5)


def test_a_session_longer_than_the_window_is_embedded_whole():
  """MiniLM reads 256 tokens; a longer session is cut into windows (each
  with [CLS] ... [SEP]) and embedded whole, as their token-weighted mean:
  what its tail says reaches its embedding and retrieval, where
  truncation gave two sessions with the same first 256 tokens one vector."""
  try:
    encoder = MiniLMEncoder(batch_size=4)
  except FileNotFoundError as e:
    pytest.skip(str(e))
  head = " ".join(f"Melanie: on day {i} we talked about the weather, which "
                  "was mild and grey." for i in range(20))
  tails = ["Caroline: I adopted a beagle named Rex last week, he loves "
           "long walks in the park.",
           "Caroline: I started learning the cello in March and practise "
           "every evening."]
  sessions = [f"{head}\n{tail}" for tail in tails]
  tokenizer = encoder.tokenizer
  windows = encoder.windows(sessions)
  for text, parts in zip(sessions, windows):
    assert len(parts) == 2 and all(len(w) <= 256 for w in parts)
    assert all(w[0] == tokenizer.cls_token_id and w[-1] ==
               tokenizer.sep_token_id for w in parts)
    # Every token read once, in order.
    assert [t for w in parts for t in w[1:-1]] == tokenizer(
        text, add_special_tokens=False, verbose=False)["input_ids"]
  before = encoder.windowed_texts
  vectors = encoder.encode(sessions)
  assert encoder.windowed_texts == before + 2
  np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
  # Truncated, the sessions were one vector; whole, they differ.
  first = encoder._encode_ids([w[0] for w in windows])
  np.testing.assert_allclose(first[0], first[1], atol=1e-6)
  assert vectors[0] @ vectors[1] < 0.99
  queries = encoder.encode(["Which dog did Caroline adopt?",
                            "Which instrument is Caroline learning?"],
                           kind="query")
  assert (queries @ vectors.T).argmax(1).tolist() == [0, 1]
  # The pooling: window embeddings weighted by their tokens, normalised.
  for parts, vector in zip(windows, vectors):
    weighted = (encoder._encode_ids(parts)
                * np.array([len(w) for w in parts])[:, None]).sum(0)
    np.testing.assert_allclose(vector, weighted / np.linalg.norm(weighted),
                               atol=1e-5)
  # A text that fits is one window and embeds as before.
  short = tails[0]
  assert encoder.windows([short]) == [[tokenizer(short)["input_ids"]]]
  np.testing.assert_allclose(encoder.encode([short])[0], encoder._encode_ids(
      [tokenizer(short)["input_ids"]])[0], atol=0)
