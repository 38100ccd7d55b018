"""Test-wide settings, applied before any test module imports torch or triton."""

import os

# No GPU on the machines that run this suite: Triton kernels run in Triton's interpreter.
# It must be set before anything imports triton (transformers may, while building MoE
# models); tests/runtime/test_triton_compile.py compiles them for real in a clean process.
# A GPU run sets TRITON_INTERPRET=0 to keep compiled kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")
# No network either: a Hub id that is not cached fails at once, naming HF_HUB_OFFLINE (huggingface_hub reads
# it at import); tests/launch/test_hub_download.py turns it off for its own Hub on a loopback port.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
