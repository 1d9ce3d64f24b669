"""ao_mdm: AO-GPT (any-order GPT as a masked diffusion model) in JAX/Flax."""
from setuptools import find_packages, setup

# Every dependency is pinned to a version that installs on Python 3.11 (see docs/ and NOTES).
INSTALL_REQUIRES = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "tensorflow-datasets==4.9.10",
    "grain==0.2.18",
    "array-record==0.8.6",
    "sentencepiece==0.2.3",
    "tiktoken==0.14.0",
    "ml-collections==1.1.0",
    "clu==0.0.12",
    "numpy==2.4.6",
    "absl-py==2.5.1",
    "tqdm==4.70.1",
    # clu's metric writers (TensorBoard event files) import TensorFlow; only the training loop
    # imports them, never ao_mdm.model or ao_mdm.sampling.
    "tensorflow-cpu==2.21.0",
    "tensorboard==2.21.0",
]

setup(
    name="ao_mdm",
    version="0.1.0",
    description="AO-GPT: any-order GPT as a masked diffusion model, in JAX/Flax",
    packages=find_packages(include=["ao_mdm", "ao_mdm.*"]),
    package_data={"ao_mdm.data": ["*.xz", "*.md", "*.json", "gpt2_bpe/*"]},
    python_requires=">=3.11,<3.12",
    install_requires=INSTALL_REQUIRES,
    extras_require={
        "test": ["pytest==9.2.0", "scipy==1.17.1", "torch==2.13.0", "transformers==5.24.0",
                 "safetensors==0.8.0"],  # transformers: a tiny GPT-2 to test import-gpt2
        "tpu": ["libtpu==0.0.42.1"],
        "torch": ["torch==2.13.0"],
        "repro": ["matplotlib==3.11.2"],  # plots of scripts/reproduce.py
    },
    entry_points={"console_scripts": ["ao-mdm=ao_mdm.main:run"]},
)
