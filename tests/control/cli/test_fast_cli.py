"""Verbs that neither serve nor benchmark never import torch, transformers or peft.

They run in a fresh interpreter (this test process has imported torch long ago), one after the
other against a fresh ``LORAPLANE_HOME``, through typer's CliRunner; after each one the
subprocess reports which of the heavy packages are in ``sys.modules``. A module-level import of
any of them on the path of a light verb (``control.cli``, ``control.tools.views``, ``control.app``,
``projections``, ...) fails here, naming the first verb that pulled it in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from control.contracts.digests import directory_digest
from tests.fixtures_control import Artifacts

HEAVY = ("torch", "transformers", "peft")
UNKNOWN = "sha256:" + "0" * 64

# Runs in the subprocess: argv[1] is a JSON list of [verb arguments, expected exit code].
_PROBE = """
import json, sys
from typer.testing import CliRunner
from control.cli.main import app

heavy = {heavy!r}
report = []
for args, _code in json.loads(sys.argv[1]):
    res = CliRunner().invoke(app, ["--json", *args])
    report.append({{"args": args, "code": res.exit_code, "out": res.output[-400:],
                   "heavy": [m for m in heavy if m in sys.modules]}})
print(json.dumps(report))
"""


def _run_verbs(home: Path, verbs: list[tuple[list[str], int]]) -> list[dict[str, object]]:
    env = {**os.environ, "LORAPLANE_HOME": str(home), "LORAPLANE_DB_URL": "",
           "LORAPLANE_ACTOR": "ops"}
    done = subprocess.run([sys.executable, "-c", _PROBE.format(heavy=HEAVY), json.dumps(verbs)],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    report: list[dict[str, object]] = json.loads(done.stdout.splitlines()[-1])
    return report


def test_light_verbs_never_import_torch_transformers_or_peft(artifacts: Artifacts,
                                                             tmp_path: Path) -> None:
    report_file = tmp_path / "eval.json"
    report_file.write_text(json.dumps({"suite": "smoke", "passed": True}))
    alpha = artifacts.adapters["alpha"]
    digest = directory_digest(alpha)
    verbs: list[tuple[list[str], int]] = [
        (["--help"], 0),
        (["base", "register", str(artifacts.base), "--tokenizer", str(artifacts.tokenizer),
          "--name", "tiny"], 0),
        (["tenant", "create", "acme"], 0),
        (["adapter", "register", str(alpha), "--tenant", "acme", "--alias", "acme-alpha"], 0),
        (["grant", "acme", "acme-alpha"], 0),
        (["adapter", "release", digest, "--evaluation", str(report_file), "--external"], 0),
        (["adapter", "list"], 0),
        (["adapter", "show", digest], 0),
        (["tenant", "policy", "acme", "--max-rank", "8"], 0),
        (["base", "list"], 0),
        (["tenant", "list"], 0),
        (["alias", "show", "acme-alpha"], 0),
        (["ticket", "issue", "--tenant", "acme", "--alias", "acme-alpha"], 0),
        (["key", "list"], 0),
        (["incident", "requests", "--adapter", digest], 0),
        (["stats"], 0),
        (["db", "status"], 0),
        (["db", "upgrade"], 0),
        (["adapter", "revoke", UNKNOWN, "--reason", "not ours"], 2),
        (["adapter", "revoke", digest, "--reason", "leak"], 0),
        (["audit", "log"], 0),
        (["audit", "verify"], 0),
        (["audit", "export"], 0),
    ]
    report = _run_verbs(tmp_path / "home", verbs)
    assert len(report) == len(verbs)
    for (args, code), r in zip(verbs, report, strict=True):
        # A verb that failed early would prove nothing about what its work imports.
        assert r["code"] == code, f"{' '.join(args)}: exit {r['code']}: {r['out']}"
        assert r["heavy"] == [], f"`loraplane {' '.join(args)}` imported {r['heavy']}"
