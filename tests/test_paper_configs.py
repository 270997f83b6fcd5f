"""The 4B configs are the paper's setting and stand on their own.

Every field of `configs/qwen3_4b.py` (training) and `configs/eval_qwen3_4b.py`
(evaluation) is one of: the paper's value (the tables below, with their
source in the paper; SPEC.md §2-6 restates them), a documented departure
(a row of docs/departures.md, "Where the paper is silent or contradicts itself"
table), or a setting the paper does not speak to (paths, endpoints,
hardware, bookkeeping). A field that is none of these, or a paper value
that changed, fails here.
"""

import importlib
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

import configs
import configs.ablations
from cmimem_jax.config import ConfigError, validate_config
from cmimem_jax.task.loop import RolloutConfig
from configs import eval_qwen3_4b, qwen3_4b, tiny

REPO = pathlib.Path(__file__).resolve().parent.parent

# (value, where the paper gives it).
PAPER_TRAINING = {
    "dataset.name": ("longmemeval", "Table 5"),
    "dataset.split": ("rl", "Table 5: the RL split"),
    "encoder.kind": ("qwen3_embedding", "Table 6: Qwen3-Embedding-0.6B"),
    "encoder.dim": (1024, "Table 6: Qwen3-Embedding-0.6B"),
    "policy.source": ("hf", "Table 6: Qwen3-4B-Instruct-2507"),
    "policy.preset": ("qwen3_4b", "Table 6: Qwen3-4B-Instruct-2507"),
    "rollout.num_rollouts": (8, "Table 7: rollouts/session"),
    "rollout.temperature": (0.8, "Table 7"),
    "rollout.top_p": (0.9, "Table 7"),
    "rollout.max_new_tokens": (6000, "Table 7: max response len."),
    "rollout.max_prompt_tokens": (20000, "Table 7: max prompt len."),
    "rollout.retrieval_top_k": (20, "Table 6: top-k (build)"),
    "rollout.constrained_dsl": (False, "§3.4: free generation"),
    "qa.judge": ("llm", "§4.1: LLM judge"),
    "qa.top_k": (10, "Table 6: top-k (QA)"),
    "qa.prompt": ("listing11", "Listing 11"),
    "memory.core_cap_chars": (5000, "Table 6: core cap"),
    "memory.compress_trigger": (0.9, "Table 6: > 90% usage"),
    "memory.compress_target_chars": (3000, "Listing 5"),
    "memory.build_top_k": (20, "Table 6: top-k (build)"),
    "memory.qa_top_k": (10, "Table 6: top-k (QA)"),
    "memory.source_chunks": (True, "§4.1 / Alg. 2: LookupChunk"),
    "memory.compressor": ("policy", "Listing 5"),
    "reward.alpha": (0.3, "Table 7: CMI/QA mix"),
    "reward.shaping": ("gaussian", "Table 7"),
    "reward.mu": (0.35, "Table 7"),
    "reward.sigma": (0.15, "Table 7"),
    "reward.lam": (1e-4, "Table 7: Tikhonov"),
    "reward.estimator": ("residual", "§3.3: residual projection"),
    "reward.empty_action_value": (-0.5, "Table 7"),
    "reward.format_penalty": (-0.5, "App. D: rho_f"),
    "reward.intra_duplicate_weight": (0.3, "Table 7 / App. D"),
    "reward.cross_duplicate_weight": (0.5, "Table 7 / App. D"),
    "reward.core_specificity_weight": (0.3, "Table 7 / App. D"),
    "reward.semantic_skip_bonus": (0.1, "Table 7: Sem-Skip +-0.1"),
    "reward.attribution_weight": (4.0, "App. D: alpha_attr"),
    "reward.conditioning.w_context": (0.5, "App. F: query weights"),
    "reward.conditioning.w_new": (0.5, "App. F: query weights"),
    "reward.conditioning.w_old": (0.3, "App. F: query weights"),
    "reward.min_memories": (2, "App. F: N_min"),
    "rl.sessions_per_batch": (32, "Table 7: train batch size"),
    "rl.epochs": (5, "Table 7"),
    "rl.learning_rate": (1e-6, "Table 7"),
    "rl.kl_beta": (0.02, "Table 7"),
    "rl.epsilon_low": (0.2, "Table 7: PPO clip"),
    "rl.epsilon_high": (0.2, "Table 7: PPO clip"),
    "rl.curriculum_tiers": (3, "Eq. 14: three percentile tiers"),
    "rl.loss_aggregation": ("token_mean", "Eq. 13; verl's token-mean"),
    "rl.weight_decay": (0.01, "MemBuilder's run: verl 0.4.0 AdamW"),
    "rl.clip_ratio_c": (3.0, "MemBuilder's run: verl 0.4.0 dual-clip"),
    "rl.kl_clamp": (10.0, "MemBuilder's run: verl 0.4.0 low_var_kl"),
    "rl.grad_clip_norm": (1.0, "MemBuilder's run: verl 0.4.0"),
    "rl.old_logprobs": ("learner", "MemBuilder's run: verl's on-policy "
                        "old log-probs, one update per step"),
}
PAPER_EVALUATION = {
    "dataset.name": ("longmemeval", "§4.1"),
    "dataset.split": ("test", "Table 5: 400 test questions"),
    "encoder.kind": ("qwen3_embedding", "Table 6"),
    "encoder.dim": (1024, "Table 6"),
    "method": ("policy", "§4: the trained builder"),
    "rag_top_k": (10, "Table 5: K in {5, 10}"),
    "judge.kind": ("llm", "§4.1"),
    "judge.prompt": ("listing11", "Listing 11"),
    "judge.endpoint.model": ("Qwen3.7-Max", "Table 6: LLM judge"),
    "answer.kind": ("endpoint", "Table 6: answer model"),
    "answer.endpoint.model": ("Qwen3.7-Max", "Table 6: answer model"),
    "builder.kind": ("local", "§4: the trained builder"),
    "builder.max_new_tokens": (6000, "Table 7: max response len."),
    "builder.endpoint.max_tokens": (6000, "Table 7: max response len."),
    "builder.constrained_dsl": (False, "§3.4: free generation"),
}
for _key in ("core_cap_chars", "compress_trigger", "compress_target_chars",
             "build_top_k", "qa_top_k", "source_chunks", "compressor"):
  PAPER_EVALUATION[f"memory.{_key}"] = PAPER_TRAINING[f"memory.{_key}"]

# Field -> the docs/departures.md row ("Topic" cell) that documents the choice.
DEPARTURES = {
    "reward.conditioning.top_k": "CMI conditioning set",
    "reward.conditioning.n_recent": "CMI conditioning set",
    "rl.log_ratio_clamp": "GRPO loss normalisation",
    "rl.snapshots": "Training states M_{t-1}",
    "rl.snapshot_refresh_epochs": "Training states M_{t-1}",
    "rl.curriculum_weights": "Eq. 14",
    "memory.compress_max_tokens": "Listing 5 / 9 budgets",
    "memory.merge_max_tokens": "Listing 5 / 9 budgets",
    "memory.merge_summarizer": "Listing 9 summariser",
    "memory.chunk_budget_chars": "Alg. 2 LookupChunk",
    "encoder.query_instruction": "Query instruction",
    "reward.profile_max_new_tokens": "App. E p_ref",
    "reward.duplicate_cosine": "Duplicate threshold",
    "reward.generic_core_patterns": "Core specificity",
    "reward.length_weight": "Length penalty",
    "reward.chars_per_token": "Length penalty",
    "reward.core_tokens_low": "Length penalty",
    "reward.core_tokens_high": "Length penalty",
    "reward.entry_chars_low": "Length penalty",
    "reward.entry_chars_high": "Length penalty",
    "reward.length_reference": "Length penalty",
    "reward.semantic_skip_cosine": "Semantic SKIP",
    "reward.semantic_skip_coverage": "Semantic SKIP",
    "reward.skip_calibration": "Semantic SKIP",
    "reward.entry_ratio_low": "Length penalty",
    "reward.entry_ratio_high": "Length penalty",
    "reward.entry_ratio_floor": "Length penalty",
    "reward.entry_ratio_ceiling": "Length penalty",
    "reward.entry_min_diff_tokens": "Length penalty",
}
# Prefixes of fields the paper does not speak to, and why.
NOT_IN_PAPER = {
    "seed": "randomness", "tensorboard": "logging",
    "mesh": "hardware (HARDWARE_FIELDS)",
    "dataset.path": "a path", "dataset.dialogues": "a slice (0: all)",
    "dataset.start": "a slice",
    "encoder.path": "a path", "policy.path": "a path",
    "policy.tokenizer": "a path ('' = the checkpoint's own)",
    "policy.init_checkpoint": "a path", "policy.seed": "random source only",
    "policy.dtype": "hardware", "policy.param_dtype": "hardware",
    "policy.remat": "hardware", "policy.attention_impl": "hardware",
    "policy.max_position_embeddings": "the checkpoint's (Qwen3-4B: 262,144)",
    "rollout.engine": "hardware", "rollout.buckets": "compiled shapes",
    "rollout.max_rows_per_wave": "memory bound of decoding",
    "rollout.decode_devices": "hardware (where rollouts decode)",
    "rollout.score_beside_decoding": "scheduling (the same samples)",
    "rollout.release_programs_each_step": "host memory of a CPU run",
    "qa.answer.": "an endpoint", "qa.judge_endpoint.": "an endpoint",
    "qa.max_failure_rate": "failed endpoint calls accepted per step",
    "judge.endpoint.": "an endpoint", "answer.endpoint.": "an endpoint",
    "builder.endpoint.": "an endpoint",
    "memory.summarizer_endpoint.": "an endpoint (merge_summarizer='external')",
    "answer.path": "a path", "answer.init_checkpoint": "a path",
    "answer.checkpoint_step": "which checkpoint",
    "answer.max_new_tokens": "the answer endpoint's max_tokens rules",
    "answer.constrained_dsl": "answers are free text",
    "builder.path": "a path", "builder.init_checkpoint": "a path",
    "builder.checkpoint_step": "App. I selects it per run",
    "limit": "a slice (0: all)",
    "memory.update_match_threshold": "Table 10's UPDATE target match",
    "rl.max_steps": "0: the epochs decide", "rl.warmup_steps": "none given",
    "rl.micro_batches": "memory (accumulation is exact)",
    "rl.logprob_chunk": "memory", "rl.share_prompts": "speed (exact)",
    "rl.validation_sessions": "bookkeeping", "rl.eval_every": "bookkeeping",
    "rl.log_rollouts": "logging",
    "checkpoint.": "bookkeeping (keep_period 10: App. I's steps 20 / 50)",
}


def _flat(config, prefix: str = "") -> dict:
  out = {}
  for key, value in config.items():
    if hasattr(value, "items") and key != "vllm":
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def _departure_topics() -> set[str]:
  """The "Topic" cells of docs/departures.md's table."""
  table = (REPO / "docs" / "departures.md").read_text()
  return {m.group(1).strip().replace("\\|", "|")
          for m in re.finditer(r"^\| ([^|]+?) \|", table, re.M)}


@pytest.mark.parametrize("module, paper", [(qwen3_4b, PAPER_TRAINING),
                                           (eval_qwen3_4b, PAPER_EVALUATION)])
def test_every_4b_field_is_the_papers_or_documented(module, paper):
  topics = _departure_topics()
  fields = _flat(module.get_config())
  for key, value in fields.items():
    if key in paper:
      expected, source = paper[key]
      assert value == expected, f"{key}={value!r}: the paper has " \
          f"{expected!r} ({source}); document a departure in " \
          "docs/departures.md"
    elif key in DEPARTURES:
      assert DEPARTURES[key] in topics, (key, DEPARTURES[key])
    else:
      assert any(key.startswith(p) for p in NOT_IN_PAPER), (
          f"{key}={value!r} is neither the paper's value nor a documented "
          "departure")
  assert set(paper) <= set(fields), set(paper) - set(fields)


def test_no_4b_config_imports_a_cpu_config():
  names = ["configs.qwen3_4b", "configs.qwen3_4b_tpu",
           "configs.qwen3_4b_h20_vllm", "configs.eval_qwen3_4b"] + [
               f"configs.ablations.{m.name}"
               for m in pkgutil.iter_modules(configs.ablations.__path__)]
  code = (f"import importlib, sys\nfor n in {names!r}:\n"
          "  importlib.import_module(n).get_config()\n"
          "print(sorted(m for m in sys.modules if m.startswith('configs')))")
  loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout
  assert "configs.paper" in loaded
  for cpu in ("configs.tiny", "configs.eval_cpu", "configs.default"):
    assert f"'{cpu}'" not in loaded, loaded


def _all_configs():
  for package in (configs, configs.ablations):
    for info in pkgutil.iter_modules(package.__path__):
      module = importlib.import_module(f"{package.__name__}.{info.name}")
      if hasattr(module, "get_config"):
        yield info.name, module.get_config()


def test_every_configs_buckets_hold_its_longest_prompt():
  checked = 0
  for name, config in _all_configs():
    for section, limit in (("rollout", "max_prompt_tokens"),
                           ("sft", "max_prompt_tokens")):
      if section in config:
        buckets = tuple(config[section].buckets)
        assert buckets and max(buckets) >= config[section][limit], (
            name, section, buckets)
        checked += 1
  assert checked >= 15


def test_validation_rejects_buckets_that_cannot_hold_a_prompt():
  config = tiny.get_config()
  config.rollout.buckets = (512,)
  with pytest.raises(ConfigError, match=r"rollout.buckets=\(512,\): the "
                     r"largest must hold rollout.max_prompt_tokens=1024"):
    validate_config(config, required=(RolloutConfig,))
  config.rollout.buckets = (1024, 512)
  with pytest.raises(ConfigError, match="ascending"):
    validate_config(config, required=(RolloutConfig,))
