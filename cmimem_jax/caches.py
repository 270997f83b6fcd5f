"""Where the project keeps what it can rebuild: converted tokenizers and
grammar-constraint tables (`cache_dir()`), and JAX's persistent compilation
cache, which every command (`serve`, `train`, `sft`, `evaluate`,
`build_memory`) turns on through `config.run_command`, so a restart loads
its compiled programs instead of compiling them again.

The compilation cache lives in `$JAX_COMPILATION_CACHE_DIR` if set, else
`cache_dir()/jax`; `JAX_ENABLE_COMPILATION_CACHE=false` turns it off. Both
are JAX's own variables, as are the thresholds and size bound set here
(`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`, ...): a user's setting of
any of them wins.
"""

from __future__ import annotations

import os
import sys

# What every command sets unless the user's environment says otherwise:
# every program is cached, however fast it compiled or small it is (JAX's
# defaults skip programs compiled in under a second: most of a server's
# and a small run's).
#
# Several processes may share the directory. JAX writes an entry in place
# (unlocked, not atomically), so a process reading an entry at the moment
# another writes it can see it incomplete: it then warns ("Error reading
# persistent compilation cache entry") and compiles that program itself;
# a result is never wrong. JAX's size bound (`jax_compilation_cache_max_size`)
# would add a file lock, but its eviction fails on every entry written
# without the bound (a directory shared with the test suite or another
# tool), so it is left to the user.
COMPILATION_CACHE_DEFAULTS: dict[str, float | int] = {
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    # -1: no minimum, and no filesystem-specific override of it.
    "jax_persistent_cache_min_entry_size_bytes": -1,
}


def cache_dir() -> str:
  """Where converted artifacts are kept: `$CMIMEM_CACHE_DIR`, else
  `$XDG_CACHE_HOME/cmimem_jax`, else `~/.cache/cmimem_jax`."""
  if os.environ.get("CMIMEM_CACHE_DIR"):
    return os.environ["CMIMEM_CACHE_DIR"]
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(
      os.path.expanduser("~"), ".cache")
  return os.path.join(root, "cmimem_jax")


def enable_compilation_cache() -> str | None:
  """Turns on JAX's persistent compilation cache for this process (before
  it compiles anything) with `COMPILATION_CACHE_DEFAULTS`; returns its
  directory, or None when `JAX_ENABLE_COMPILATION_CACHE=false` or the
  directory cannot be created (said on stderr: the command then runs,
  compiling everything)."""
  import jax
  if not jax.config.jax_enable_compilation_cache:
    return None
  directory = (jax.config.jax_compilation_cache_dir
               or os.path.join(cache_dir(), "jax"))
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:
    print(f"warning: no compilation cache ({e}); set "
          "JAX_COMPILATION_CACHE_DIR to a writable directory, or "
          "JAX_ENABLE_COMPILATION_CACHE=false", file=sys.stderr)
    return None
  jax.config.update("jax_compilation_cache_dir", directory)
  for name, value in COMPILATION_CACHE_DEFAULTS.items():
    if name.upper() not in os.environ:
      jax.config.update(name, value)
  return directory
