"""An OpenAI-compatible server for our Flax policy and encoder: the server
is `serving.Server`.

  python -m cmimem_jax.serve --config=configs/serve_cpu.py --port=8000
"""

from absl import app, flags, logging

from cmimem_jax.config import define_command_line_flags
from cmimem_jax.serving import Server

_HOST = flags.DEFINE_string("host", "127.0.0.1", "Interface to bind.")
_PORT = flags.DEFINE_integer("port", 8000, "Port (0: any free port).")


def main(argv: list[str]) -> None:
  del argv
  server = Server(flags.FLAGS.config, _HOST.value, _PORT.value)
  logging.info("serving %s at %s", flags.FLAGS.config.serve.model_name,
               server.base_url)
  print(f"serving at {server.base_url}", flush=True)
  server.serve_forever()


if __name__ == "__main__":
  define_command_line_flags(workdir=False)
  app.run(main)
