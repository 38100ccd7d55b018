"""The bundled demo checkpoint: a toy Llama trained on CPython's own documentation."""

from pathlib import Path

from shardserve.planner.model_source import DEMO_MODEL_NAME  # noqa: F401 (one name, the planner's)

DEMO_MODEL_DIR = Path(__file__).parent / "model"
