"""An OpenAI-compatible server for our Flax policy and encoder: the server
is `serving.Server`.

  python -m cmimem_jax.serve --config=configs/serve_cpu.py --port=8000

Prints one line when listening (`/health` answers 503 while it warms up),
one per warm-up program (`warm-up k/n: batch B, prompt bucket T`), and
`ready at URL` once `/health` answers 200. Ctrl-C or SIGTERM drains the
requests in flight (`serve.shutdown_timeout_s`, then 503) and stops it.
Compiled programs are kept in JAX's persistent compilation cache
(`cmimem_jax.caches`), so a restart loads them.
"""

import os
import signal
import sys

from absl import flags

from cmimem_jax.config import run_command, validate_config
from cmimem_jax.serving import SERVE_SECTIONS, Server

_HOST = flags.DEFINE_string("host", "127.0.0.1", "Interface to bind.")
_PORT = flags.DEFINE_integer("port", 8000, "Port (0: any free port).")


def _progress(k: int, n: int, batch: int, bucket: int, seconds: float
              ) -> None:
  print(f"warm-up {k}/{n}: batch {batch}, prompt bucket {bucket} "
        f"({seconds:.1f} s)", flush=True)


def _say_stopped_then_end(signum: int, frame: object) -> None:
  """SIGTERM's handler once uvicorn has drained and handed the signal back:
  the same last line as Ctrl-C, then the signal's own exit status (what a
  supervisor expects)."""
  del frame
  print("server stopped", flush=True)
  signal.signal(signum, signal.SIG_DFL)
  signal.raise_signal(signum)


def main(argv: list[str]) -> None:
  del argv
  # uvicorn captures SIGTERM while serving and re-raises it, after the
  # drain, to the handler installed before it started: this one.
  signal.signal(signal.SIGTERM, _say_stopped_then_end)
  sections = validate_config(flags.FLAGS.config, required=SERVE_SECTIONS)
  try:
    server = Server(sections, _HOST.value, _PORT.value, _progress,
                    lambda url: print(f"ready at {url}", flush=True))
    print(f"listening at {server.base_url}: warming up "
          f"{len(server.programs)} programs (/health answers 503 until "
          "ready)", flush=True)
    server.serve_forever()
  except KeyboardInterrupt:  # Ctrl-C; uvicorn re-raises it once drained.
    pass
  # A generate or encode call still running in a worker thread cannot be
  # interrupted: leave without waiting for it. (SIGTERM ends in
  # `_say_stopped_then_end` instead.)
  print("server stopped", flush=True)
  sys.stderr.flush()
  os._exit(0)


if __name__ == "__main__":
  run_command(main, workdir=False)
