"""The bundled demo checkpoint: a toy Llama trained on CPython's own documentation."""

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).parent / "model"
DEMO_MODEL_NAME = "shardserve-demo"
