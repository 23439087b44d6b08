"""Check a serve config's raygen applications before `serve run` deploys it.

    python -m deployments.preflight serve_config.yaml

`serve run deployments.app:build_app ...` checks the model itself before Ray starts
(`app.check_model`), but a config file's builder runs inside Serve's controller, whose
build task retries a failure three times with back-off before `serve run` reports it.
This runs the same checks in the shell, one line and exit status 1 per bad application;
`make serve` runs it first."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from deployments.app import check_model
from deployments.config import AppArgs
from shards.checkpoints.resolve import CheckpointError

BUILDER = "deployments.app:build_app"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    config = yaml.safe_load(Path(argv[0]).read_text())
    failed = 0
    for app in config.get("applications", []):
        if app.get("import_path") != BUILDER:
            continue
        name = app.get("name", "default")
        try:
            check_model(AppArgs.model_validate(app.get("args") or {}))
        except ValidationError as exc:
            fields = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                               for e in exc.errors())
            print(f"raygen: application {name}: {fields}", file=sys.stderr)
            failed += 1
        except CheckpointError as exc:
            print(f"raygen: application {name}: {exc}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
