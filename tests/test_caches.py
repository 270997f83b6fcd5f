"""Every command keeps its compiled programs in JAX's persistent
compilation cache (`caches.enable_compilation_cache`, from `run_command`):
where it lives, how it is moved or turned off, and two processes sharing
it at once."""

import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# A command (through `run_command`, as every entry point) compiling
# PROGRAMS tiny programs in an order of its own; prints how many it loaded
# from the cache, and the cache directory.
COMMAND = """
import json, random, sys
import jax, jax.numpy as jnp
from cmimem_jax.config import run_command

hits = []
jax.monitoring.register_event_listener(
    lambda event, **kw: hits.append(event)
    if event == "/jax/compilation_cache/cache_hits" else None)

def main(argv):
  programs, seed = int(argv[1]), int(argv[2])
  order = list(range(programs))
  random.Random(seed).shuffle(order)
  x = jnp.ones(3)
  for i in order:
    out = jax.jit(lambda x, i=i: jnp.sin(x) * i + i)(x)
    assert abs(float(out[0]) - (0.8414709848 * i + i)) < 1e-4
  print(json.dumps({"hits": len(hits),
                    "dir": jax.config.jax_compilation_cache_dir}))

run_command(main, workdir=False)
"""


def run(env_overrides: dict[str, str | None], programs: int = 2,
        seed: int = 0) -> subprocess.Popen:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith("JAX_PERSISTENT_CACHE")
         and k != "JAX_COMPILATION_CACHE_DIR"}
  env.update({k: v for k, v in env_overrides.items() if v is not None})
  return subprocess.Popen(
      [sys.executable, "-c", COMMAND, "--config=configs/tiny.py", "--",
       str(programs), str(seed)], cwd=ROOT, env=env, text=True,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE)


# JAX writes entries in place: a process reading one while another writes
# it warns so, and compiles that program itself (`caches`).
TORN_READ = "Error reading persistent compilation cache entry"


def result(process: subprocess.Popen) -> dict:
  out, err = process.communicate(timeout=300)
  assert process.returncode == 0, err[-3000:]
  # No other warning or error (JAX reports a cache entry it cannot write
  # as a warning, then goes on).
  lines = [line for line in err.splitlines() if TORN_READ not in line
           and "warnings.warn(" not in line]
  assert not any("arning" in line or "rror" in line for line in lines), err
  return json.loads(out.splitlines()[-1])


def test_the_cache_defaults_under_cmimem_cache_dir_and_moves_or_turns_off(
    tmp_path):
  default = tmp_path / "cmimem" / "jax"
  moved = tmp_path / "moved"
  settings = [({"CMIMEM_CACHE_DIR": str(tmp_path / "cmimem")}, str(default)),
              ({"JAX_COMPILATION_CACHE_DIR": str(moved)}, str(moved)),
              ({"CMIMEM_CACHE_DIR": str(tmp_path / "off"),
                "JAX_ENABLE_COMPILATION_CACHE": "false"}, None)]
  processes = [run(env) for env, _ in settings]
  for process, (_, directory) in zip(processes, settings):
    assert result(process)["dir"] == directory
  # Every program is cached, however small and fast to compile.
  assert len(list(default.glob("*-cache"))) >= 2
  assert len(list(moved.glob("*-cache"))) >= 2
  assert not (tmp_path / "off").exists()


def test_two_processes_share_one_cache_at_once(tmp_path):
  """Both compile the same 30 programs in different orders at the same
  time, writing and reading the same entries: both correct, no cache
  error; a third process then loads every program."""
  env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path)}
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    first, second = pool.map(lambda seed: result(run(env, 30, seed)), (1, 2))
  assert first["dir"] == second["dir"] == str(tmp_path)
  assert result(run(env, 30, 3))["hits"] >= 30
