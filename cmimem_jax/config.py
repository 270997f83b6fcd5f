"""Config validation shared by every entry point.

Configs are `ml_collections.ConfigDict`s defined in `configs/*.py` and loaded
with absl `config_flags` (`--config=configs/x.py --config.a.b=v`). Each
section has a typed, frozen dataclass (a `Section`) beside the code that
reads it (`data.DatasetConfig`, `encoders.EncoderConfig`,
`memory.builder.MemoryConfig`, `task.loop.RLConfig`, ...). An entry point
passes the section types it reads, and only those, to `validate_config`
before anything is built or compiled; it builds each one and reports every
problem of all of them together in one `ConfigError`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

import ml_collections

from cmimem_jax import storage


# Who compresses the core block / summarises MERGEs
# (`memory.compression.memory_editors`).
MEMORY_EDITORS = ("none", "policy", "answer")


class ConfigError(ValueError):
  """An invalid config; the message lists every problem found."""

  @classmethod
  def listing(cls, problems: Sequence[str]) -> ConfigError:
    """The error for `problems`, one per line."""
    return cls("invalid config:\n  " + "\n  ".join(problems))


class MissingDependency(ImportError):
  """An optional package that a chosen setting needs is not installed; the
  message says which setting and ends with the install command."""


def positive_int(value: object) -> bool:
  """An int (not a bool) > 0."""
  return isinstance(value, int) and not isinstance(value, bool) and value > 0


def finite_number(value: object, low: float = -math.inf,
                  high: float = math.inf) -> bool:
  """A finite int or float (not a bool) in [low, high]."""
  return (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and low <= value <= high)


class _NotSet:
  """A field that is missing or of the wrong type while a section's rules
  run (`Section.from_config`)."""

  def __repr__(self) -> str:
    return "NOT_SET"


NOT_SET = _NotSet()


def need(section: Any, key: str, ok: bool | Callable[[Any], bool],
         requirement: str) -> list[str]:
  """`["key=value: must be requirement"]` when `ok` (a bool, or a predicate
  of `section.key`) is false, else `[]`: one problem of a section's
  `invalid`."""
  value = getattr(section, key)
  if value is NOT_SET:  # Reported as missing or mistyped already.
    return []
  if callable(ok):
    try:
      ok = bool(ok(value))
    except TypeError:
      ok = False
  return [] if ok else [f"{key}={value!r}: must be {requirement}"]


def location_problem(path: str, value: str, requirement: str,
                     directory: bool = False) -> str | None:
  """Why `value` (config field `path`) names no existing file (or
  `directory`), local or on object storage; None when it does."""
  try:
    target = storage.path(value)
    ok = target.is_dir() if directory else target.exists()
  except storage.StorageError as e:
    return f"{path}: {e}"
  return None if ok else f"{path}={value!r}: must be {requirement}"


class Section:
  """A config section as a typed, frozen dataclass (subclasses are
  `@dataclasses.dataclass(frozen=True)`), built from its ml_collections
  section by `from_config`, which collects every problem (unknown and
  missing keys, wrong types, then the section's own `invalid` rules)
  instead of raising at the first. A field without a default must be in
  the config; one with a default may be left out.

  `SECTION` is the key of the section in the whole config; "" for fields
  read from the top level of the config (`seed`, `mesh`, `method`, ...:
  no unknown-key check there, the top level holds every section). Built
  directly (`RewardConfig(alpha=2.0)`), a section raises `ValueError`
  listing its `invalid` problems.
  """

  SECTION: ClassVar[str] = ""

  def __post_init__(self) -> None:
    problems = list(self.invalid())
    if problems:
      raise ValueError("; ".join(problems))

  def invalid(self) -> Iterator[str]:
    """This section's range and cross-field problems, each starting with
    the field it names (`"top_p=2: must be in (0, 1]"`); the caller adds
    the section's path. Runs on well-typed values only."""
    return iter(())

  def invalid_with(self, sections: Sections) -> Iterator[str]:
    """Rules between this section and others built beside it (whole dotted
    paths); a rule whose other section was not asked for is skipped."""
    del sections
    return iter(())

  def as_config_dict(self) -> dict[str, Any]:
    """This section as its ml_collections section's `to_dict()` held it:
    keys sorted, nested sections as dicts, and a field its config left
    out (at its default) left out: what a file recording a job's settings
    writes (`evaluation.run.result_settings`), so it stays byte-identical
    for the same config. A section built directly holds every field."""
    given = getattr(self, _GIVEN, None)
    held = {}
    for name in sorted(f.name for f in dataclasses.fields(self)):
      if given is None or name in given:
        value = getattr(self, name)
        held[name] = (value.as_config_dict() if isinstance(value, Section)
                      else value)
    return held

  @classmethod
  def from_config(cls: type[_S], section: Any,
                  problems: list[str] | None = None,
                  path: str | None = None) -> _S | None:
    """Builds the section from its ml_collections `section` (the whole
    config for a top-level one).

    Args:
      section: the `ConfigDict` (any mapping).
      problems: where problems go, one line each, naming `path.key`; None
        raises `ConfigError` listing them instead.
      path: the section's dotted path in the config (default `SECTION`).

    Returns:
      The section, or None where it had problems.
    """
    collected: list[str] = [] if problems is None else problems
    before = len(collected)
    built = _build(cls, section, cls.SECTION if path is None else path,
                   collected)
    if len(collected) > before:
      if problems is None:
        raise ConfigError.listing(collected)
      return None
    return built


_S = TypeVar("_S", bound=Section)


def unchecked(cls: type[_S], **values: Any) -> _S:
  """A `cls` of `values` built without `__post_init__` (which raises at
  the first problem), so its `invalid` can list them all."""
  built = object.__new__(cls)
  for name, value in values.items():
    object.__setattr__(built, name, value)
  return built


def _key(path: str, key: str) -> str:
  return f"{path}.{key}" if path else key


def _build(cls: type[_S], section: Any, path: str,
           problems: list[str]) -> _S | None:
  """`cls` from `section` without raising: its problems go to
  `problems`."""
  if not hasattr(section, "keys"):
    problems.append(f"{path}={section!r}: must be a section")
    return None
  hints = typing.get_type_hints(cls)
  structural = False  # An unknown or missing key: no rules can run.
  fields = {f.name: f for f in dataclasses.fields(cls)}
  if path:  # The top level holds every section: no unknown-key check.
    import difflib
    for key in sorted(set(section.keys()) - set(fields)):
      near = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
      problems.append(f"{_key(path, key)}: unknown setting"
                      + (f" (nearest known: {_key(path, near[0])})"
                         if near else ""))
      structural = True
  values = {}
  for name, field in fields.items():
    if name not in section:
      if (field.default is dataclasses.MISSING
          and field.default_factory is dataclasses.MISSING):
        problems.append(f"{_key(path, name)}: missing")
        structural = True
        continue
      values[name] = (field.default if field.default is not dataclasses.MISSING
                      else field.default_factory())
      continue
    values[name] = _typed(section[name], hints[name], _key(path, name),
                          problems)
  # The section's own rules, on an instance built without `__post_init__`
  # (which would raise at the first): a rule of a missing or mistyped
  # field (`NOT_SET`) is skipped (`need`), as is every rule after one that
  # cannot compare them. An instance that breaks only rules is returned,
  # so a section holding it checks its own rules too; the problems say it
  # is invalid.
  for name in fields:
    if values.get(name, _INVALID) is _INVALID:
      values[name] = NOT_SET
  built = unchecked(cls, **values)
  object.__setattr__(built, _GIVEN,
                     frozenset(name for name in fields if name in section))
  try:
    for line in built.invalid():
      problems.append(_key(path, line))
  except (TypeError, AttributeError):
    if not (structural or NOT_SET in values.values()):
      raise
  if structural or any(v is NOT_SET for v in values.values()):
    return None
  return built


_INVALID = object()
# The attribute of a built section naming the fields its config gave
# (`Section.as_config_dict`); not a field: equality ignores it.
_GIVEN = "_config_keys"


def _typed(value: Any, hint: Any, path: str, problems: list[str]) -> Any:
  """`value` as the field type `hint` wants it (a list as a tuple, an int
  as a float, a section as its dataclass), or `_INVALID` with a problem
  added."""
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (typing.Union, types.UnionType):
    if value is None and type(None) in args:
      return None
    (hint,) = [a for a in args if a is not type(None)]
    return _typed(value, hint, path, problems)
  if isinstance(hint, type) and issubclass(hint, Section):
    built = _build(hint, value, path, problems)
    return _INVALID if built is None else built
  requirement = None
  if hint is Any:
    return value
  if hint is bool:
    ok, requirement = isinstance(value, bool), "True or False"
  elif hint is int:
    ok = isinstance(value, int) and not isinstance(value, bool)
    requirement = "an integer"
  elif hint is float:
    ok, requirement = finite_number(value), "a finite number"
    value = float(value) if ok else value
  elif hint is str:
    ok, requirement = isinstance(value, str), "a string"
  elif origin is tuple:
    item = args[0]
    ok = isinstance(value, (tuple, list)) and all(
        _typed(v, item, path, []) is not _INVALID for v in value)
    requirement = f"a list of {_TYPE_NAMES.get(item, item)}"
    if ok:
      value = tuple(_typed(v, item, path, []) for v in value)
  elif origin is dict or hint is dict:
    ok, requirement = hasattr(value, "keys"), "a section"
    value = dict(value) if ok else value
  else:
    raise TypeError(f"{path}: unsupported field type {hint!r}")
  if not ok:
    problems.append(f"{path}={value!r}: must be {requirement}")
    return _INVALID
  return value


_TYPE_NAMES = {int: "integers", float: "finite numbers", str: "strings",
               bool: "booleans"}


class Sections:
  """The typed sections of one config (`validate_config`'s result), by
  type: `sections[RLConfig]`."""

  def __init__(self, built: dict[type[Section], Section]):
    self._built = built

  def __getitem__(self, kind: type[_S]) -> _S:
    return self._built[kind]  # type: ignore[return-value]

  def get(self, kind: type[_S]) -> _S | None:
    return self._built.get(kind)  # type: ignore[return-value]

  def __contains__(self, kind: type[Section]) -> bool:
    return kind in self._built


def validate_config(config: ml_collections.ConfigDict,
                    required: Sequence[type[Section]]) -> Sections:
  """Builds the sections a caller reads, and only those, reporting every
  problem of all of them in one `ConfigError`: a config file serves
  several tools (`qwen3_4b.py`: `build_expert_states` and `train`), and a
  field one tool never reads (`rl.snapshots` for `build_expert_states`)
  must not stop it.

  The callers pass the section types in (each defined beside the code that
  reads it: `data.DatasetConfig`, `task.loop.RLConfig`, ...), so this
  module, the lowest layer but storage, imports none of them and nothing
  registers itself at import time: what a command validates is what its
  own `required` names.

  Args:
    config: The loaded config.
    required: The section types the caller reads; each must be present.

  Returns:
    The built sections (`sections[RLConfig]`).

  Raises:
    ConfigError: listing every problem, one per line.
  """
  problems: list[str] = []
  built: dict[type[Section], Section] = {}
  for kind in required:
    if kind.SECTION and kind.SECTION not in config:
      problems.append(f"{kind.SECTION}: missing section")
      continue
    section = config[kind.SECTION] if kind.SECTION else config
    instance = _build(kind, section, kind.SECTION, problems)
    # A section that breaks only its own rules still takes part in the
    # rules across sections: every problem is listed at once.
    if instance is not None:
      built[kind] = instance
  sections = Sections(built)
  own_problems = bool(problems)
  for instance in built.values():
    try:
      problems.extend(instance.invalid_with(sections))
    except (ArithmeticError, TypeError, ValueError):
      # A rule across sections reading a value its own rules refused
      # (e.g. a zero divisor): that refusal is already listed.
      if not own_problems:
        raise
  if problems:
    raise ConfigError.listing(problems)
  return sections


@dataclasses.dataclass(frozen=True)
class EndpointConfig(Section):
  """An OpenAI-compatible endpoint section. It lives with the config
  checks that read it; `cmimem_jax.client` re-exports it."""

  SECTION: ClassVar[str] = "endpoint"  # Nested: `qa.answer`, ...

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

  def invalid(self) -> Iterator[str]:
    yield from need(self, "base_url", lambda v: v.startswith("http"),
                    "an http(s) URL")
    for key in ("timeout_s", "backoff_s", "max_backoff_s", "temperature"):
      yield from need(self, key, lambda v: v >= 0, ">= 0")
    yield from need(self, "max_retries", lambda v: v >= 0, ">= 0")
    for key in ("concurrency", "max_tokens"):
      yield from need(self, key, positive_int, "a positive integer")


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
