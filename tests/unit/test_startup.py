"""`rapidtrain plan` imports only what the plan needs: torch (device detection, parameter shapes on meta), never
torch.compile's machinery, DeepSpeed, Transformers or Datasets, each of which adds seconds to the answer."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch._dynamo", "torch._inductor", "deepspeed", "transformers", "datasets")
PROBE = """
import io, json, sys, contextlib
from rapidtrain.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    code = main(sys.argv[1:])
print(json.dumps({"code": code, "plan": "train-iters" in out.getvalue() or len(out.getvalue()) > 200,
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("deepspeed", "transformers",
                                   "datasets") or m in ("torch._dynamo", "torch._inductor"))}))
"""


def test_plan_imports_no_compiler_deepspeed_or_transformers():
    result = subprocess.run([sys.executable, "-c", PROBE, "plan", "--train-iters", "10", "--lr", "1e-3"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["code"] == 0 and report["plan"]
    assert report["loaded"] == [], f"rapidtrain plan imported {report['loaded']}"


def test_the_models_package_imports_without_torch():
    """The plan reads models/config.py and attention_backends.py; the package must not pull torch in for them."""
    probe = ("import sys; import rapidtrain.models.config, rapidtrain.models.attention_backends; "
             "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "False"
