"""An OpenAI-compatible server for our Flax policy and encoder: the server
is `serving.Server`.

  python -m cmimem_jax.serve --config=configs/serve_cpu.py --port=8000
"""

import os
import sys

from absl import flags, logging

from cmimem_jax.config import run_command
from cmimem_jax.serving import Server

_HOST = flags.DEFINE_string("host", "127.0.0.1", "Interface to bind.")
_PORT = flags.DEFINE_integer("port", 8000, "Port (0: any free port).")


def main(argv: list[str]) -> None:
  del argv
  server = Server(flags.FLAGS.config, _HOST.value, _PORT.value)
  logging.info("serving %s at %s", flags.FLAGS.config.serve.model_name,
               server.base_url)
  print(f"serving at {server.base_url}", flush=True)
  try:
    server.serve_forever()
  except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has stopped.
    pass
  # A generate or encode call still running in a worker thread cannot be
  # interrupted: leave without waiting for it. (SIGTERM never gets here:
  # uvicorn re-raises it after the graceful shutdown, ending the process.)
  print("server stopped", flush=True)
  sys.stderr.flush()
  os._exit(0)


if __name__ == "__main__":
  run_command(main, workdir=False)
