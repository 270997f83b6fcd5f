"""Two CPU processes on localhost take one sharded GRPO step together
(`jax.distributed`, per-host data) and match one process with the same
four devices."""

import json
import os
import socket
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "multihost_worker.py")
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(env, process_id, processes, port, devices):
  # `own_devices_env`: the worker sets its own device count.
  env = dict(env, PYTHONPATH=os.path.abspath(ROOT))
  return subprocess.Popen(
      [sys.executable, WORKER, str(process_id), str(processes), str(port),
       str(devices)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True, env=env)


def _result(proc):
  out, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, err[-3000:]
  return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_two_processes_match_one_process(own_devices_env):
  port = _free_port()
  hosts = [_run(own_devices_env, i, 2, port, 2) for i in range(2)]
  single = _result(_run(own_devices_env, 0, 1, 0, 4))
  results = [_result(p) for p in hosts]
  assert [r["devices"] for r in results] == [4, 4]
  for r in results:
    for key in ("loss", "grad_norm", "kl", "param_checksum"):
      assert r[key] == pytest.approx(single[key], rel=1e-5, abs=1e-6), key
