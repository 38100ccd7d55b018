"""The bundled demo checkpoint: a toy Llama trained on CPython's own documentation."""

from pathlib import Path

from shardserve.planner.model_source import DEMO_MODEL_NAME

DEMO_MODEL_DIR = Path(__file__).parent / "model"
__all__ = ["DEMO_MODEL_DIR", "DEMO_MODEL_NAME"]
