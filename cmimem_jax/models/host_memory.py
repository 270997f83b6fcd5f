"""Keeping a long-running job's host heap from holding freed memory: large
blocks go straight back to the OS when freed, and freed-but-kept heap pages
are returned after a large transient build."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# glibc's `mallopt` parameter (malloc.h).
_M_MMAP_THRESHOLD = -3
# Blocks of at least this size get their own mapping, unmapped on free.
# glibc's default threshold starts at 128 KiB but rises to the size of each
# freed mapped block (up to 32 MiB), so after a few step / decode buffers
# have come and gone, blocks below 32 MiB (per-chunk logits, per-layer
# activations and gradients: 5-25 MB) are carved from the heap and stay
# resident after they are freed: +0.5 GiB peak for one SmolLM2-135M GRPO
# step (BENCHMARKS.md "Train step memory"). A fixed threshold also turns
# that adjustment off.
MMAP_THRESHOLD_BYTES = 1 << 20


@functools.cache
def _libc():
  """glibc, or None where the C library lacks its malloc extensions
  (musl, macOS)."""
  name = ctypes.util.find_library("c")
  try:
    libc = ctypes.CDLL(name) if name else None
    return libc if libc is not None and all(
        hasattr(libc, f) for f in ("malloc_trim", "mallopt")) else None
  except OSError:
    return None


def release_free_heap() -> bool:
  """Hands glibc's freed-but-kept heap pages back to the OS.

  Loading a GGUF file (dequantised copies), building a grammar constraint
  (vocabulary-wide tables) or compiling a program (XLA / LLVM's many small
  allocations) frees hundreds of MB that glibc keeps mapped; without this
  they stay in the process's resident set through training (~0.35 GB
  after loading SmolLM2-135M, ~0.4 GB after compiling its train step).

  Returns:
    True when memory was released; False where there is no `malloc_trim`
    or nothing could be returned.
  """
  libc = _libc()
  return bool(libc.malloc_trim(0)) if libc is not None else False


@functools.cache
def return_large_blocks() -> bool:
  """From now on, every host allocation of `MMAP_THRESHOLD_BYTES` or more
  (XLA:CPU's device buffers among them) is unmapped when freed, so it
  leaves the resident set at once (see `MMAP_THRESHOLD_BYTES`). Costs a
  page-fault pass over each new large buffer; idempotent.

  Returns:
    True when glibc took the setting; False elsewhere (no `mallopt`).
  """
  libc = _libc()
  return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
              ) if libc is not None else False
