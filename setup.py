"""Packaging for rapidtrain: a Megatron-style training launcher that speaks Rapidformer's flags.

torch is required but never pulled in with an open range: install `torch==2.13.0` (or your CUDA
build) first; `torch>=2.6` is then already satisfied and pip installs nothing more for it.
"""

from setuptools import find_packages, setup

setup(
    name="rapidtrain",
    version="0.1.0",
    description="Training launcher for transformers with Rapidformer's command line",
    python_requires=">=3.11",
    packages=find_packages(include=["rapidtrain", "rapidtrain.*"]),
    package_data={"rapidtrain.config": ["megatron_flags.json"]},  # the Megatron-family flag surface (read at parse)
    install_requires=[
        "torch>=2.6",
        "numpy",
        "tqdm",
        "sentencepiece",
        "tokenizers",
        "tensorboard",
        "matplotlib",  # the demo's loss curve (PNG)
    ],
    extras_require={
        "deepspeed": ["deepspeed"],
        "hf": ["transformers", "datasets", "peft", "accelerate"],
        # --optimizer adamw_8bit / paged_adamw_8bit / adamw_4bit, --load-in-4bit / --load-in-8bit: bitsandbytes
        # (0.50 steps its 8-bit optimizers and runs 4/8-bit layers on CPU too) and torchao (DTensor layouts).
        "lowbit": ["bitsandbytes>=0.50", "torchao>=0.18"],
        # --wandb-project and --mlflow-experiment. mlflow-skinny is MLflow's client without its server and UI
        # dependencies; SQLAlchemy and Alembic let it write its default store, a local SQLite file.
        "tracking": ["wandb", "mlflow-skinny", "sqlalchemy", "alembic"],
        "dev": ["pytest", "pytest-timeout", "pytest-xdist>=3.6", "ruff", "mypy>=1.10", "hypothesis"],
    },
    entry_points={"console_scripts": ["rapidtrain=rapidtrain.cli:main"]},
)
