#!/usr/bin/env bash
# Download, into .whl/ (git-ignored), the wheels bench/run_gpu.sh needs on the GPU machine (the
# server, its client, xgrammar): the versions this checkout's .venv runs, with their dependencies,
# built for the image's Python 3.12 on x86-64. The device tool carries them (`carry: [".whl"]`).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
pins=$("$py" - <<'PY'
import re
from importlib.metadata import PackageNotFoundError, requires, version
seen, todo = {}, ["fastapi", "uvicorn", "openai", "pydantic", "prometheus-client", "xgrammar"]
# the GPU image has these (its own CUDA builds): never carry them
image = {"torch", "triton", "numpy", "transformers", "tokenizers", "safetensors", "huggingface-hub", "pyyaml",
         "regex", "requests", "tqdm", "filelock", "fsspec", "jinja2", "markupsafe", "sympy", "networkx",
         "packaging", "hf-xet", "mpmath", "setuptools"}
while todo:
    name = todo.pop().lower().replace("_", "-")
    if name in seen or name in image or name.startswith("nvidia-"):
        continue
    try:
        seen[name] = version(name)
    except PackageNotFoundError:  # a dependency for another platform or Python
        continue
    for line in requires(name) or []:
        if "extra ==" not in line and "python_version < '3.1" not in line:
            todo.append(re.match(r"[A-Za-z0-9_.\-]+", line).group(0))
print(" ".join(f"{name}=={v}" for name, v in sorted(seen.items())))
PY
)
rm -rf .whl && mkdir -p .whl
platforms=()
for n in 28 27 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl $pins 2>&1 | grep -v '^WARNING: Location' || true
ls .whl
