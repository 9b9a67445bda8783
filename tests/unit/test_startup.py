"""`rapidtrain plan` imports only what the plan needs: no torch (the device comes from the operating system, the
parameter shapes from the settings), never torch.compile's machinery, DeepSpeed, Transformers or Datasets, each of
which adds seconds to the answer."""

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
                                   "datasets") or m in ("torch._dynamo", "torch._inductor")),
                  "torch": "torch" in sys.modules}))
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


SMALL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "10"]
LAYOUTS = [
    [],  # the demo data's plan
    [*SMALL, "--world-size", "8", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
     "--sequence-parallel", "--bf16"],
    [*SMALL, "--world-size", "4", "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size",
     "2", "--use-expert-residual-network", "--swiglu"],
    [*SMALL, "--world-size", "2", "--zero-3-memory-optimization", "--bf16", "--qk-layernorm"],
    [*SMALL, "--world-size", "2", "--zero-2-memory-optimization", "--bf16", "--cpu-offload"],
    [*SMALL, "--world-size", "2", "--oss-memory-optimization", "--optimizer", "adafactor"],
    [*SMALL, "--world-size", "2", "--fsdp-memory-optimization", "--optimizer", "sgd", "--normalization", "RMSNorm"],
    [*SMALL, "--world-size", "2", "--fp16", "--optimizers", "apex_lamb", "--auto-micro-batch-size",
     "--memory-budget-gb", "2"],
    ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
     "--max-position-embeddings", "2048", "--micro-batch-size", "1", "--global-batch-size", "1536",
     "--train-iters", "10", "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
     "--world-size", "1024", "--device", "cuda", "--device-name", "H100", "--bf16"],
    ["--entry", "pretrain_bert", *SMALL, "--world-size", "2", "--bert-binary-head"],
]


def test_plans_of_every_layout_import_no_torch():
    """The plan's answer time is its imports: torch alone takes 1-2 s on a CPU machine (more on a GPU node's shared
    file system). Each plan must equal what it says, with torch never imported."""
    for flags in LAYOUTS:
        result = subprocess.run([sys.executable, "-c", PROBE, "plan", *flags], capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, (flags, result.stderr[-2000:])
        report = json.loads(result.stdout.strip().splitlines()[-1])
        assert report["code"] == 0 and report["plan"], flags
        assert not report["torch"], f"rapidtrain plan {' '.join(flags)} imported torch"
