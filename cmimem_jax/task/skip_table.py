"""The Semantic SKIP calibration table: per encoder, the two thresholds of
the coverage rule (`RewardConfig.semantic_skip_cosine`,
`semantic_skip_coverage`), as `tools/skip_calibration.py` chose them.

An encoder's vectors decide what a cosine means, so a threshold chosen
with one encoder is never used with another: entries are keyed by
`encoders.encoder_identity` (kind, width, query instruction), and a
config whose encoder has no entry gets no thresholds (`calibrated`
raises; training refuses to start). The packaged table
(`skip_calibration.json` beside this file) holds the encoders this
repository can run (the embedded all-MiniLM-L6-v2, the hashing encoder
of the tiny configs); `reward.skip_calibration` names another table (a
run's own calibration, e.g. Qwen3-Embedding's before a 4B run, or the
rehearsal's stand-in encoder, whose identity is the real one's).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from cmimem_jax.config import ConfigError
from cmimem_jax.data.files import write_atomic
from cmimem_jax.encoders import EncoderConfig, encoder_identity
from cmimem_jax.task.reward import RewardConfig

PACKAGED_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              "skip_calibration.json")
CALIBRATE_HINT = ("python -m tools.skip_calibration --config=CONFIG "
                  "--locomo=LOCOMO.json --table=TABLE")


def table_path(path: str) -> str:
  """The table a `reward.skip_calibration` value names ("": packaged)."""
  return path or PACKAGED_TABLE


def read_table(path: str) -> list[dict[str, Any]]:
  """The entries of the table at `path` ([] when it does not exist)."""
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return json.load(f)["entries"]


def find_entry(path: str, identity: dict[str, Any]) -> dict[str, Any] | None:
  """The entry of `identity` in the table at `path`, or None."""
  return next((e for e in read_table(path) if e["encoder"] == identity), None)


def write_entry(path: str, entry: dict[str, Any]) -> None:
  """Adds `entry` to the table at `path`, replacing one of the same
  encoder (written whole or not at all)."""
  entries = [e for e in read_table(path) if e["encoder"] != entry["encoder"]]
  entries.append(entry)
  entries.sort(key=lambda e: json.dumps(e["encoder"], sort_keys=True))
  write_atomic(path, json.dumps({"entries": entries}, indent=1) + "\n")


def calibrated(reward: RewardConfig, encoder_config: EncoderConfig
               ) -> RewardConfig:
  """`reward` with the coverage thresholds of
  `encoder_config`'s encoder from its table, unless it sets them itself.

  Raises:
    ConfigError: the table has no entry for this encoder.
  """
  if reward.semantic_skip_cosine is not None:
    return reward
  identity = encoder_identity(encoder_config)
  path = table_path(reward.skip_calibration)
  entry = find_entry(path, identity)
  if entry is None:
    raise ConfigError(
        f"reward: no Semantic SKIP calibration for encoder {identity} in "
        f"{path}: run `{CALIBRATE_HINT}` with this config first (a recipe "
        "stage), then train with --config.reward.skip_calibration=TABLE")
  return dataclasses.replace(
      reward, semantic_skip_cosine=entry["semantic_skip_cosine"],
      semantic_skip_coverage=entry["semantic_skip_coverage"])
