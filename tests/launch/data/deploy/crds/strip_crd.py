"""Strip a CustomResourceDefinition's YAML (stdin) to the JSON schema of one version (stdout) for the tests.

Usage (the commands that made the files beside this one are in README.md):
    git show COMMIT:PATH/TO/crd.yaml | python strip_crd.py v1 > kind.schema.json

Stripped: every `description`, and every embedded PodSpec (a schema whose properties include
`containers` and `initContainers`), which becomes an open object: test_deploy.py validates each pod
template against the Kubernetes schemas themselves (kubernetes-validate).
"""

from __future__ import annotations

import json
import sys

import yaml

POD_SPEC_STUB = {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                 "x-stripped": "a PodSpec: validated against the Kubernetes schemas instead"}


def strip(schema: object) -> object:
    if isinstance(schema, list):
        return [strip(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    if {"containers", "initContainers"} <= set(schema.get("properties", {})):
        return POD_SPEC_STUB
    return {key: strip(value) for key, value in schema.items() if key != "description"}


def main() -> None:
    crd = yaml.safe_load(sys.stdin)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == sys.argv[1]]
    json.dump(strip(version["schema"]["openAPIV3Schema"]), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
