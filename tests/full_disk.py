"""A full disk for checkpoint tests: the error tensorstore raises on
ENOSPC injected into orbax's write path, and the one line a save that hit
it must print (tests/rl/test_checkpoint_failures.py,
tests/test_train_failures.py)."""

import json

from orbax.checkpoint._src.serialization import serialization

# What tensorstore raises through orbax on a full disk (copied from a real
# failure on a 20 MB tmpfs).
TENSORSTORE_ENOSPC = (
    'RESOURCE_EXHAUSTED: Error writing "params.w/0.0" in OCDBT database at '
    'local file "{path}": Failed to write 10010624 bytes to file 18: No '
    "space left on device [os_error_code='28']")


def assert_full_disk_line(message: str, checkpoint, metrics, last: int
                          ) -> None:
  """`message` is the one line of a save that found the disk full."""
  assert "\n" not in message
  assert message.startswith(f"checkpoint {checkpoint} not saved: no space "
                            "left on the device (a checkpoint holds ")
  assert message.endswith(f"{metrics} ends at step {last}, the last saved "
                          "checkpoint: free space, then rerun to resume from "
                          f"step {last}")


def fail_writes_of(step: int, monkeypatch) -> None:
  """Every array write of checkpoint `step` raises tensorstore's ENOSPC."""
  write = serialization.async_serialize_from_host

  async def full_disk(values, spec, **kwargs):
    if f"/{step}.orbax-checkpoint-tmp" in json.dumps(spec, default=str):
      raise ValueError(TENSORSTORE_ENOSPC.format(path=spec))
    return await write(values, spec, **kwargs)
  monkeypatch.setattr(serialization, "async_serialize_from_host", full_disk)
