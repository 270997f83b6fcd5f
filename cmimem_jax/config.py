"""Config validation shared by every entry point.

Configs are `ml_collections.ConfigDict`s defined in `configs/*.py` and loaded
with absl `config_flags` (`--config=configs/x.py --config.a.b=v`). The
sections an entry point reads, and only those, are checked before anything
is built or compiled (the shared sections here, the others by the package
that owns them through `register_section`); all problems are reported
together in one `ConfigError`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections

from cmimem_jax import storage


DATASETS = ("longmemeval", "locomo", "memoryagentbench")
# "" = the job's default (`data.registry.default_split`); the others are
# LongMemEval's official partitions.
DATASET_SPLITS = ("", "all", "sft", "rl", "test")
ENCODERS = ("hashing", "minilm", "qwen3_embedding", "openai")
# The kinds that embed queries with `encoder.query_instruction`; the
# others are symmetric and take none.
INSTRUCTED_ENCODERS = ("qwen3_embedding", "openai")


@dataclasses.dataclass(frozen=True)
class EndpointConfig:
  """An OpenAI-compatible endpoint section. It lives with the config
  checks that read it; `cmimem_jax.client` re-exports it."""

  base_url: str = "http://127.0.0.1:8000/v1"
  model: str = ""
  api_key_env: str = "OPENAI_API_KEY"  # Read from the environment.
  timeout_s: float = 60.0
  max_retries: int = 3                 # Attempts after the first.
  backoff_s: float = 1.0               # Doubles per retry, with jitter.
  max_backoff_s: float = 30.0
  concurrency: int = 8
  temperature: float = 0.0
  max_tokens: int = 512

  @classmethod
  def from_config(cls, section: Any) -> EndpointConfig:
    """From an ml_collections section (unknown keys are an error)."""
    values = dict(section)
    unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"unknown endpoint settings {sorted(unknown)}")
    return cls(**values)


class ConfigError(ValueError):
  """An invalid config; the message lists every problem found."""


class MissingDependency(ImportError):
  """An optional package that a chosen setting needs is not installed; the
  message says which setting and ends with the install command."""


_MISSING = object()


class _Checker:
  """Collects problems instead of stopping at the first one."""

  def __init__(self, config: ml_collections.ConfigDict):
    self.config = config
    self.problems: list[str] = []

  def get(self, path: str) -> object:
    node = self.config
    for part in path.split("."):
      if not hasattr(node, "keys") or part not in node:
        return _MISSING
      node = node[part]
    return node

  def check(self, path: str, predicate: Callable[[object], bool],
            requirement: str) -> None:
    value = self.get(path)
    if value is _MISSING:
      self.problems.append(f"{path}: missing")
      return
    try:
      ok = predicate(value)
    except TypeError:
      ok = False
    if not ok:
      self.problems.append(f"{path}={value!r}: must be {requirement}")

  def check_location(self, path: str, requirement: str,
                     directory: bool = False) -> None:
    """`path` names an existing file (or `directory`), local or on object
    storage; a location that cannot be used says why."""
    value = self.get(path)
    if value is _MISSING:
      self.problems.append(f"{path}: missing")
      return
    if not isinstance(value, str):
      self.problems.append(f"{path}={value!r}: must be {requirement}")
      return
    try:
      target = storage.path(value)
      ok = target.is_dir() if directory else target.exists()
    except storage.StorageError as e:
      self.problems.append(f"{path}: {e}")
      return
    if not ok:
      self.problems.append(f"{path}={value!r}: must be {requirement}")


def _positive_int(value: object) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value > 0


def finite_number(value: object, low: float = -math.inf,
                  high: float = math.inf) -> bool:
  """A finite int or float (not a bool) in [low, high]."""
  return (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and low <= value <= high)


def _fraction(value: object) -> bool:
  return isinstance(value, (int, float)) and 0.0 < value <= 1.0


def _check_dataset(c: _Checker) -> None:
  c.check("dataset.name", lambda v: v in DATASETS, f"one of {DATASETS}")
  c.check_location("dataset.path", "an existing file (see README for where "
                   "the benchmarks live)")
  if c.get("dataset.split") is not _MISSING:
    c.check("dataset.split", lambda v: v in DATASET_SPLITS,
            f"one of {DATASET_SPLITS} ('': the job's default)")
    if c.get("dataset.split") not in ("", "all") and (
        c.get("dataset.name") != "longmemeval"):
      c.problems.append("dataset.split: only LongMemEval has splits")


def _check_encoder(c: _Checker) -> None:
  c.check("encoder.kind", lambda v: v in ENCODERS, f"one of {ENCODERS}")
  instruction = c.get("encoder.query_instruction")
  if instruction is not _MISSING and not isinstance(instruction, str):
    c.problems.append("encoder.query_instruction must be a string")
  elif instruction not in (_MISSING, "") and (
      c.get("encoder.kind") not in INSTRUCTED_ENCODERS):
    c.problems.append(
        f"encoder.query_instruction is set, but encoder.kind="
        f"{c.get('encoder.kind')!r} takes no instruction (only "
        f"{INSTRUCTED_ENCODERS} do)")
  if c.get("encoder.kind") in ("hashing", "openai"):
    c.check("encoder.dim", _positive_int, "a positive integer")
  elif c.get("encoder.kind") == "minilm":
    # all-MiniLM-L6-v2's width: another would index and calibrate a
    # vector size the model never produces.
    dim = c.get("encoder.dim")
    if dim not in (_MISSING, 384):
      c.problems.append(f"encoder.dim={dim!r}: must be 384 (all-MiniLM-L6-v2's "
                        "width) for encoder.kind='minilm'")
  if c.get("encoder.kind") == "openai":
    c.check("encoder.endpoint.base_url",
            lambda v: isinstance(v, str) and v.startswith("http"),
            "an http(s) URL")
  elif c.get("encoder.kind") == "qwen3_embedding":
    c.check("encoder.path", lambda v: isinstance(v, str) and os.path.isdir(v),
            "a HF checkpoint folder")


def _check_memory(c: _Checker) -> None:
  c.check("memory.core_cap_chars", _positive_int, "a positive integer")
  c.check("memory.compress_trigger", _fraction, "in (0, 1]")
  c.check("memory.compress_target_chars", _positive_int, "a positive integer")
  c.check("memory.build_top_k", _positive_int, "a positive integer")
  c.check("memory.qa_top_k", _positive_int, "a positive integer")
  c.check("memory.chunk_budget_chars",
          lambda v: isinstance(v, int) and v >= 0, "a non-negative integer")
  c.check("memory.source_chunks", lambda v: isinstance(v, bool),
          "True or False")
  c.check("memory.compressor", lambda v: v in MEMORY_EDITORS,
          f"one of {MEMORY_EDITORS}")
  merge_summarizers = MEMORY_EDITORS + ("external",)
  c.check("memory.merge_summarizer", lambda v: v in merge_summarizers,
          f"one of {merge_summarizers}")
  if c.get("memory.merge_summarizer") == "external":
    c.check("memory.summarizer_endpoint.base_url",
            lambda v: isinstance(v, str) and v.startswith("http"),
            "an http(s) URL")
    c.check("memory.summarizer_endpoint.model",
            lambda v: isinstance(v, str) and bool(v), "a model name")
    try:
      EndpointConfig.from_config(c.config.memory.summarizer_endpoint)
    except (TypeError, ValueError) as e:
      c.problems.append(f"memory.summarizer_endpoint: {e}")
  for key in ("memory.compress_max_tokens", "memory.merge_max_tokens"):
    c.check(key, _positive_int, "a positive integer (tokens)")
  c.check("memory.update_match_threshold",
          lambda v: isinstance(v, float) and -1.0 <= v <= 1.0, "in [-1, 1]")
  memory = c.config.get("memory")
  if memory is not None and {"compress_target_chars", "core_cap_chars"} <= set(
      memory.keys()) and memory.compress_target_chars > memory.core_cap_chars:
    c.problems.append("memory.compress_target_chars must not exceed "
                      "memory.core_cap_chars")


_SECTIONS: dict[str, Callable[[_Checker], None]] = {
    "dataset": _check_dataset,
    "encoder": _check_encoder,
    "memory": _check_memory,
}


def register_section(name: str, check: Callable[[_Checker], None]) -> None:
  """Adds the validator for a config section: each subsystem registers its
  own when imported (`reward` by `cmi`, `rl` by `task.loop`, `judge` by
  `evaluation.run`), so this module depends on none of them."""
  _SECTIONS[name] = check


def validate_config(config: ml_collections.ConfigDict,
                    required: tuple[str, ...]) -> None:
  """Checks the sections a caller reads, and only those: a config file
  serves several tools (`qwen3_4b.py`: `build_expert_states` and
  `train`), and a field one tool never reads (`rl.snapshots` for
  `build_expert_states`) must not stop it.

  Args:
    config: The loaded config.
    required: The sections the caller reads: each must be present, and
      each one's registered checks run (a section without registered
      checks is only required).

  Raises:
    ConfigError: listing every problem, one per line.
  """
  checker = _Checker(config)
  for section in required:
    if section not in config:
      checker.problems.append(f"{section}: missing section")
    elif section in _SECTIONS:
      _SECTIONS[section](checker)
  if checker.problems:
    raise ConfigError("invalid config:\n  " + "\n  ".join(checker.problems))


# Who compresses the core block / summarises MERGEs
# (`memory.compression.memory_editors`).
MEMORY_EDITORS = ("none", "policy", "answer")


def memory_defaults() -> ml_collections.ConfigDict:
  """Table 6 memory settings, shared by every config file."""
  return ml_collections.ConfigDict({
      "core_cap_chars": 5000,
      "compress_trigger": 0.9,
      "compress_target_chars": 3000,
      "build_top_k": 20,
      "qa_top_k": 10,
      # Retrieval-indexed memory ("RM", §4.1): episodic/procedural hits bring
      # their source turns to the answer model. False: flat memory, the RM
      # ablation of Table 3.
      "source_chunks": True,
      # = memory.retrieval.DEFAULT_CHUNK_BUDGET_CHARS (ten ~16k-character
      # LongMemEval sessions; Alg. 2 itself sets no budget).
      "chunk_budget_chars": 160_000,
      "update_match_threshold": 0.9,
      # Listing 5 over the cap: "policy" (the model building memories),
      # "answer" (the QA answer model) or "none" (keep the newest lines).
      "compressor": "none",
      # Listing 9 for episodic MERGE: the same choices ("none" keeps the
      # policy's own merged text), or "external": App. H.3's "external
      # summarizer", the endpoint `summarizer_endpoint`.
      "merge_summarizer": "none",
      "summarizer_endpoint": dataclasses.asdict(EndpointConfig()),
      # Answer budgets (tokens) of those calls: Listing 5 returns up to
      # compress_target_chars (3,000) characters of JSON.
      "compress_max_tokens": 1536,
      "merge_max_tokens": 1024,
  })


def qa_chunk_budget(memory: ml_collections.ConfigDict) -> int:
  """Characters of source turns `LookupChunk` may add to a QA context
  (0 when `memory.source_chunks` is off)."""
  return memory.chunk_budget_chars if memory.source_chunks else 0


def define_command_line_flags(workdir: bool = True,
                              flag_values: Any = None) -> None:
  """Defines `--config` (an ml_collections config file, overridable with
  `--config.a.b=v`) and optionally `--workdir`, once, in `flag_values`
  (absl's global `flags.FLAGS` by default): every entry point (`train`,
  `evaluate`, `serve`, `build_memory`) shares the global ones, so they can
  be imported together; a tool defines them in its own `FLAGS`. Read them
  as `flags.FLAGS.config` / `flags.FLAGS.workdir`."""
  from absl import flags
  from ml_collections import config_flags
  values = flags.FLAGS if flag_values is None else flag_values
  if "config" not in values:
    config_flags.DEFINE_config_file("config", None, "Config file.",
                                    flag_values=values)
  if workdir and "workdir" not in values:
    flags.DEFINE_string("workdir", None, "Output directory (checkpoints, "
                        "metrics, banks, results).", flag_values=values)


# Set to show the traceback of a user error (or pass --verbosity=1).
TRACEBACK_ENV = "CMIMEM_TRACEBACK"


class Interrupted(Exception):
  """A job stopped by a signal after saving what it had (exit code
  128 + the signal's number)."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.signum = signum


class CallsFailed(RuntimeError):
  """More of a job's endpoint calls failed than it accepts: what they
  would have produced is missing, never guessed (exit 1, one line)."""


def check_failures(failed: int, total: int, max_rate: float, subject: str,
                   kept: str = "") -> None:
  """Raises `CallsFailed` when any of `total` calls failed and either all
  did or more than `max_rate` of them (a user's `--max_failure_rate`).

  Args:
    subject: what failed, naming the endpoint ("teacher calls to URL").
    kept: what was kept for a rerun, said after the count.
  """
  if not failed or (failed < total and failed <= max_rate * total):
    return
  count = f"all {total}" if failed == total else f"{failed} of {total}"
  over = ("" if failed == total else
          f" (more than --max_failure_rate={max_rate:g})")
  raise CallsFailed(f"{count} {subject} failed{over}"
                    + (f"; {kept}" if kept else ""))


def _fail(message: str, code: int) -> None:
  import sys
  print(f"error: {message}", file=sys.stderr)
  raise SystemExit(code)


def _show_tracebacks() -> bool:
  from absl import flags
  verbose = flags.FLAGS.is_parsed() and flags.FLAGS.verbosity >= 1
  return verbose or bool(os.environ.get(TRACEBACK_ENV))


def run_command(main: Callable[[list[str]], Any], workdir: bool = True,
                flag_values: Any = None, compilation_cache: bool = True,
                positional: bool = False) -> None:
  """Runs a command's `main` under absl: an entry point's with the global
  `--config` and `--workdir`, or, given `flag_values`, a tool's with its
  own flags (`tools/`: each tool keeps its flags in its own
  `flags.FlagValues`, as tools share names; `--config` / `--workdir` when
  it defines them), absl's (`--verbosity`, `--help`) beside them.
  Positional arguments reach `main` after the program's name (a tool
  that takes none, `positional=False`, refuses them); an `int` `main`
  returns is the exit code.

  A mistake a user can make prints one line on stderr and exits: 2 for
  usage (a flag, an override, the config: `ConfigError`; a setting whose
  package is not installed: `MissingDependency`), 1 for data, workdir and
  runtime errors (`ValueError`, `OSError`, `RuntimeError`); a job stopped
  by SIGTERM / SIGINT exits 128 + signal. `--verbosity=1` or
  `CMIMEM_TRACEBACK=1` shows the traceback instead. Logs below WARNING
  are off unless `--verbosity` is given. JAX's persistent compilation
  cache is on (`caches.enable_compilation_cache`) unless
  `compilation_cache=False` (a tool that times compiles)."""
  import sys
  from absl import app, flags

  from cmimem_jax.caches import enable_compilation_cache
  if flag_values is None:
    define_command_line_flags(workdir)
  values = flags.FLAGS if flag_values is None else flag_values

  def parse(argv: list[str]) -> list[str]:
    if flag_values is not None and any(
        a in ("-h", "--help", "--helpshort", "--helpfull") for a in argv[1:]):
      print((sys.modules["__main__"].__doc__ or "").strip() + "\n\nflags:\n"
            + flag_values.get_help())
      raise SystemExit(0)
    try:
      # A tool's flags first (its `--config` defines the override flags
      # in its own FlagValues as it loads), then absl's, which refuse any
      # flag neither knows.
      rest = (argv if flag_values is None
              else flag_values(argv, known_only=True))
      rest = _checked(values, flags.FLAGS(rest),
                      positional or flag_values is None)
      if not any(a.startswith(("--verbosity", "-v")) for a in argv[1:]):
        # Our progress and summaries only; --verbosity=0 brings back the
        # INFO logs (ours, orbax's, ...).
        from absl import logging
        logging.set_verbosity(logging.WARNING)
      return rest
    except Exception as e:  # noqa: BLE001 - any bad flag, file, override.
      _usage_error(e, argv, "config" in values)
      raise  # Unreachable: _usage_error exits.

  def guarded(argv: list[str]) -> None:
    # Before anything compiles: restarts load the programs compiled before.
    if compilation_cache:
      enable_compilation_cache()
    result = _call(main, argv, values)
    if isinstance(result, int) and not isinstance(result, bool):
      raise SystemExit(result)

  app.run(guarded, flags_parser=parse)


def _checked(values: Any, rest: list[str], positional: bool) -> list[str]:
  """`rest` (the program's name, then the positional arguments) once the
  parsed `values` are whole: a `--config` given and loaded (a bad file
  fails here), no positional argument unless the command takes some."""
  from absl import app
  if "config" in values:
    config = values.config  # Loads the file: a bad one fails here.
    if config is None:
      raise app.UsageError("--config=FILE is required")
    config.keys()
  if not positional and rest[1:]:
    raise app.UsageError(f"unexpected arguments: {' '.join(rest[1:])}")
  return rest


def _usage_error(error: Exception, argv: list[str], configured: bool
                 ) -> None:
  """A command line that did not parse: one line, exit 2 (the traceback
  with CMIMEM_TRACEBACK=1)."""
  if os.environ.get(TRACEBACK_ENV):
    raise error
  text = (unknown_override(argv)
          or " ".join(str(error).split()).strip('"').strip("'"))
  hint = ("--config FILE or a --config.KEY=VALUE override; "
          if configured else "")
  _fail(f"{text} ({hint}{TRACEBACK_ENV}=1 shows the traceback)", 2)


def _call(main: Callable[[list[str]], Any], argv: list[str], values: Any
          ) -> Any:
  """`main(argv)` with a user's mistakes as one line and an exit code
  (`run_command`'s); returns what it returns."""
  import sys
  from absl import app
  try:
    if "workdir" in values and values.workdir:
      # A location nobody can write (a mangled URL, a missing client or
      # bucket) is refused before anything loads or compiles.
      storage.path(values.workdir)
    return main(argv)
  except Interrupted as e:
    print(str(e), file=sys.stderr)
    raise SystemExit(128 + e.signum) from None
  except (ConfigError, MissingDependency, app.UsageError) as e:
    if _show_tracebacks():
      raise
    _fail(str(e), 2)
  except (ValueError, OSError, RuntimeError) as e:
    if _show_tracebacks():
      raise
    _fail(f"{type(e).__name__}: {e} (--verbosity=1 shows the traceback)", 1)


def parse_flags(flag_values: Any, argv: Sequence[str],
                program: str = "tool", positional: bool = True
                ) -> list[str]:
  """Parses a tool's command line `argv` (flags and positional arguments,
  no program name) into its `flag_values` afresh: a flag `argv` does not
  give is at its default, `--config` and its `--config.KEY=VALUE`
  overrides are loaded from `argv`. Returns what `run_command` hands the
  tool's `main`: `[program, *positional]`. Errors are raised."""
  import sys
  # Override flags defined by an earlier parse's config would be defined
  # twice; the config flag finds its overrides in sys.argv.
  for name in [n for n in flag_values if n.startswith("config.")]:
    delattr(flag_values, name)
  flag_values.unparse_flags()
  command_line, saved = [program, *argv], sys.argv
  sys.argv = command_line
  try:
    return _checked(flag_values, flag_values(command_line), positional)
  finally:
    sys.argv = saved


def run_in_process(main: Callable[[list[str]], Any], flag_values: Any,
                   argv: Sequence[str], program: str = "tool",
                   positional: bool = True) -> Any:
  """What `run_command(main, flag_values=flag_values)` runs for the
  command line `argv`, in this process: the flags parsed afresh
  (`parse_flags`), then `main`; a user's mistake is its one line on
  stderr and a `SystemExit` with its code, as on the command line.
  Returns what `main` returns (an exit code too: not raised)."""
  try:
    rest = parse_flags(flag_values, argv, program, positional)
  except Exception as e:  # noqa: BLE001 - any bad flag, file, override.
    _usage_error(e, [program, *argv], "config" in flag_values)
    raise  # Unreachable: _usage_error exits.
  return _call(main, rest, flag_values)


def field_paths(config: Any, prefix: str = "") -> list[str]:
  """Every dotted field of a config, sections included ("rl",
  "rl.max_steps", ...)."""
  paths = []
  for key, value in config.items():
    paths.append(f"{prefix}{key}")
    if hasattr(value, "items"):
      paths += field_paths(value, f"{prefix}{key}.")
  return paths


def _load_config_file(spec: str) -> Any:
  """The config of `--config=FILE[:ARG]`, loaded as config_flags does."""
  import importlib.util
  path, _, argument = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location("_user_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(argument) if argument else module.get_config()


def unknown_field(config: Any, path: str) -> str | None:
  """"unknown field rl.steps (nearest known: rl.max_steps)" when `path`
  names no field of `config`, else None."""
  known = field_paths(config)
  if path in known:
    return None
  import difflib
  near = difflib.get_close_matches(path, known, n=1, cutoff=0.5)
  leaf = path.rsplit(".", 1)[-1]
  if not near:  # The same name in another section, say.
    near = [p for p in known if p.rsplit(".", 1)[-1] == leaf][:1]
  return f"unknown field {path}" + (f" (nearest known: {near[0]})" if near
                                    else "")


def unknown_override(argv: list[str]) -> str | None:
  """For a command line whose `--config.KEY=VALUE` names no field of its
  `--config` file: the `unknown_field` line of the first such KEY (None
  when every KEY is known or the file itself does not load)."""
  import re
  spec = next((a.split("=", 1)[1] for a in argv
               if a.startswith("--config=")), None)
  if spec is None:
    return None
  try:
    config = _load_config_file(spec)
  except Exception:  # noqa: BLE001 - the file's own error is reported.
    return None
  for argument in argv:
    match = re.match(r"--config\.([^=]+)", argument)
    if match:
      problem = unknown_field(config, match.group(1))
      if problem:
        return problem
  return None


def apply_overrides(config: ml_collections.ConfigDict,
                    overrides: dict[str, object]) -> ml_collections.ConfigDict:
  """Sets dotted fields in place (`{"rl.max_steps": 3}`), as
  `--config.rl.max_steps=3` does on the command line; returns `config`."""
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for part in parents:
      node = node[part]
    node[leaf] = value
  return config


CONFIG_FILE = "config.json"


def config_json(config: ml_collections.ConfigDict) -> str:
  """What a job writes to `workdir/config.json` (`CONFIG_FILE`): the config
  it was started (or last resumed) with, overrides included, so a workdir
  says what produced it."""
  return config.to_json_best_effort(indent=2, sort_keys=True) + "\n"


def write_config(config: ml_collections.ConfigDict, workdir: str) -> str:
  """Writes `config_json(config)` to `workdir/config.json` (local or object
  storage, atomically); returns the path."""
  path = storage.join(workdir, CONFIG_FILE)
  storage.write_atomic(path, config_json(config))
  return path
