"""`python tests/compat/pai_sweep_extract.py PAI_GIT_DIR`: regenerate tests/compat/pai_sweep.json, the command lines
Pai-Megatron-Patch's Megatron-Core launch scripts (2025-26) hand to `torchrun`.

Not a test: a tool that needs a clone of alibaba/Pai-Megatron-Patch. Each script runs for real under bash, with a
`torchrun` early on PATH that records its argv (and a `python` that answers 8 GPUs), once per value of its
`MODEL_SIZE` case block for each positional vector its README shows (pretraining, SFT on idxmap data, SFT on raw
JSON with MP_DATASET_TYPE=raw), and once per value of each option switch (precision, recompute, flash attention,
distributed optimizer, optimizer offload, sequence parallelism, SFT packing) on the first vector. Only facts are
kept: the script, the positional arguments and environment, and the argv torchrun received, paths as placeholders.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

OUT = Path(__file__).with_name("pai_sweep.json")
# The Megatron-Core launch scripts touched in 2025-26 (chatlearn/verl ones start RL frameworks, not torchrun).
SCRIPTS = [
    "examples/qwen3/run_mcore_qwen3.sh", "examples/qwen3_next/run_mcore_qwen3.sh",
    "examples/qwen3_next/run_mcore_qwen3_lite.sh", "examples/deepseek_v3/run_mcore_deepseek.sh",
    "examples/deepseek_v3/run_mcore_deepseek_lite.sh", "examples/moonlight/run_mcore_moonlight.sh",
    "examples/qwen2_5/run_mcore_qwen.sh", "examples/qwen2/run_mcore_qwen.sh", "examples/qwen2/run_mcore_qwen2_moe.sh",
    "examples/qwq/run_mcore_qwen.sh", "examples/qwen1_5/run_pretrain_mcore_qwen.sh",
    "examples/qwen1_5/run_finetune_mcore_qwen_withGA.sh", "examples/mistral/run_mcore_mistral.sh",
    "examples/llama3_1/run_mcore_llama3_1.sh", "examples/llama3/run_pretrain_mcore_llama.sh",
    "examples/llama3/run_finetune_mcore_llama_withGA.sh", "examples/llama3/run_pretrain_llama_70b.sh",
    "examples/llama2/run_pretrain_mcore_llama.sh", "examples/llama2/run_mcore_llama2_70b.sh",
    "examples/deepseek_v2/run_mcore_deepseek.sh", "examples/qwen2_5_vl/run_mcore_qwen.sh",
    "examples/qwen2_vl/run_mcore_qwen.sh", "examples/qwen3_vl/run_mcore_qwen.sh",
    "examples/qwen3_vl/run_mcore_qwen3_vl_lite.sh", "examples/qwen3_omni/run_mcore_qwen3_omni.sh",
    "examples/llava_mcore/run_mcore_llava.sh",
]
# A positional argument's value where the script's README gives no example.
DEFAULTS = {"ENV": "dsw", "MEGATRON_PATCH_PATH": "../../", "BATCH_SIZE": "1", "GLOBAL_BATCH_SIZE": "8",
            "LR": "1e-5", "MIN_LR": "1e-6", "SEQ_LEN": "128", "PAD_LEN": "128", "DECODER_SEQ_LEN": "1024",
            "EXTRA_VOCAB_SIZE": "293", "PR": "bf16", "TP": "1", "PP": "1", "CP": "1", "ETP": "1", "EP": "1",
            "EMP": "1", "SP": "true", "DO": "true", "FL": "true", "SFT": "false", "AC": "sel", "TE": "true",
            "MOE": "false", "OPTIMIZER_OFFLOAD": "false", "SAVE_INTERVAL": "100000", "TRAIN_TOKENS": "100000000",
            "WARMUP_TOKENS": "10000", "TRAIN_ITERS": "10000", "LR_WARMUP_ITERS": "100"}
# Each option switch's values, tried one at a time on the first vector.
OPTIONS = {"PR": ["fp16", "bf16", "fp8"], "AC": ["sel", "full", "offload", "none"], "FL": ["true", "false"],
           "DO": ["true", "false"], "OPTIMIZER_OFFLOAD": ["false", "0.5", "1.0"], "SP": ["true", "false"],
           "TE": ["true", "false"], "MOE": ["true", "false"]}
PATH_ARGS = {"DATASET_PATH", "VALID_DATASET_PATH", "PRETRAIN_CHECKPOINT_PATH", "OUTPUT_BASEPATH"}


def positional_names(text: str) -> list[str]:
    """NAME for each `NAME=$N` / `NAME=${N}` of the script's header, in positional order."""
    found = {int(n): name for name, n in re.findall(r"^([A-Z_]+)=\$\{?(\d+)\}?\s*(?:#.*)?$", text, flags=re.M)}
    return [found.get(i, f"ARG{i}") for i in range(1, max(found, default=0) + 1)]


def model_sizes(text: str) -> list[str]:
    sizes = re.findall(r'\$MODEL_SIZE"?\s*=\s*"?([A-Za-z0-9.]+)', text)
    return list(dict.fromkeys(sizes))


def readme_samples(readme: str, script: str) -> list[tuple[dict[str, str], list[str]]]:
    """(environment, positional words) of each `sh SCRIPT \\ ...` example in the README."""
    out = []
    for block in re.findall(r"```(?:bash|shell|sh)?\n(.*?)```", readme, flags=re.S):
        match = re.search(rf"(?:sh|bash) {re.escape(script)}\s*\\?\n((?:[^\n]*\\\s*\n)*[^\n]*)", block)
        if not match:
            continue
        env = dict(re.findall(r"export (MP_[A-Z_]+)=\"?([^\"\s]+)\"?", block[:match.start()]))
        out.append((env, re.sub(r"\\\s*\n", " ", match.group(1)).split()))
    return out


def run_script(folder: Path, script: str, args: list[str], env: dict[str, str], work: Path) -> list[list[str]]:
    record = work / "record.jsonl"
    record.unlink(missing_ok=True)
    environ = {"PATH": f"{work / 'bin'}:/usr/bin:/bin", "HOME": str(work), "PAI_RECORD": str(record),
               "WORLD_SIZE": "1", "RANK": "0", "KUBERNETES_CONTAINER_RESOURCE_GPU": "8", "MASTER_ADDR": "localhost",
               "MASTER_PORT": "23456", **env}
    script_path = folder / script
    # the 2024 scripts read CURRENT_DIR without setting it (under set -e they stop there), the lite ones cd to
    # /mnt/Pai-Megatron-Patch: both point at this copy
    environ["CURRENT_DIR"] = str(script_path.parent)
    text = script_path.read_text()
    if "/mnt/Pai-Megatron-Patch" in text:
        script_path.write_text(text.replace("/mnt/Pai-Megatron-Patch", str(folder)))
    done = subprocess.run(["bash", script_path.name, *args], cwd=script_path.parent, env=environ,
                          capture_output=True, text=True, timeout=60)
    calls = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    if not calls:
        print(f"  no torchrun: {script} {' '.join(args)} {env}: rc={done.returncode} {done.stderr[-300:]!r}")
    return calls


def placeholders(tokens: list[str], work: Path) -> list[str]:
    table = [(str(work / "data" / "train.json"), "{DATA}/train.json"),
             (str(work / "data" / "valid.json"), "{DATA}/valid.json"),
             (str(work / "data" / "mmap_text_document"), "{DATA}"),
             (str(work / "ckpt"), "{CKPT}"), (str(work / "out" / "checkpoint"), "{SAVE}"),
             (str(work / "out" / "tensorboard"), "{LOGS}"), (str(work / "out"), "{OUT}"), (str(work), "{WORK}")]
    out = []
    for token in tokens:
        for path, name in table:
            if path in token:
                token = token.replace(path, name)
        token = re.sub(r"\{(SAVE|LOGS)\}/[^\s'\"]*", r"{\1}", token)  # names with dates and sizes
        out.append(token)
    return out


def sweep(folder: Path, work: Path) -> list[dict]:
    (work / "data").mkdir(parents=True, exist_ok=True)
    (work / "ckpt").mkdir(exist_ok=True)
    (work / "ckpt" / "config.json").write_text("{}")
    for name in ("merges.txt", "tokenization_moonshot.py", "tiktoken.model"):  # what the scripts copy on
        (work / "ckpt" / name).write_text("")
    bin_dir = work / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "torchrun").write_text("#!/bin/sh\nexec /usr/bin/python3 -c 'import json,sys,os; "
                                      "open(os.environ[\"PAI_RECORD\"],\"a\").write(json.dumps(sys.argv[1:])+\"\\n\")'"
                                      " \"$@\"\n")
    (bin_dir / "python").write_text("#!/bin/sh\necho 8\n")
    for tool in ("torchrun", "python"):
        (bin_dir / tool).chmod(0o755)
    runs: list[dict] = []
    for script in SCRIPTS:
        text = (folder / script).read_text()
        names = positional_names(text)
        sizes = model_sizes(text)
        readme = next((p.read_text() for p in sorted((folder / script).parent.glob("README*.md"))), "")
        samples = readme_samples(readme, Path(script).name)
        vectors: list[tuple[dict[str, str], dict[str, str]]] = []
        for env, words in samples or [({}, [])]:
            given = dict(zip(names, words, strict=True)) if len(words) == len(names) else {}
            values = {name: given.get(name, DEFAULTS.get(name, sizes[0] if sizes else "x")) for name in names}
            dataset = values.get("DATASET_PATH", "")
            if dataset.endswith(".json"):  # Pai's README sets SFT=true with its JSON examples
                env = {**env, "MP_DATASET_TYPE": "raw"}
                if "SFT" in values:
                    values["SFT"] = "true"
            if env.get("MP_DATASET_TYPE") == "raw" and "SFT" in values:  # Pai reads raw JSON in SFT only
                values["SFT"] = "true"
            vectors.append((env, values))
        if "SFT" in names:  # each branch at least once, from the first vector where the README lacks it
            kinds = {(values["SFT"], env.get("MP_DATASET_TYPE", "idxmap")) for env, values in vectors}
            for sft, kind in (("false", "idxmap"), ("true", "idxmap"), ("true", "raw")):
                if (sft, kind) not in kinds:
                    vectors.append(({"MP_DATASET_TYPE": "raw"} if kind == "raw" else {},
                                    {**vectors[0][1], "SFT": sft}))
        jobs: list[tuple[dict[str, str], dict[str, str]]] = []
        for env, values in vectors:
            for size in sizes or [values.get("MODEL_SIZE", "")]:
                jobs.append((env, {**values, "MODEL_SIZE": size} if "MODEL_SIZE" in values else values))
        if names:
            env, values = vectors[0]
            options = dict(OPTIONS)
            if "OPTIMIZER_OFFLOAD = 'static'" in text:  # these scripts take a policy, not a fraction
                options["OPTIMIZER_OFFLOAD"] = ["false", "static", "auto"]
            for name, choices in options.items():
                if name in values:
                    jobs += [(env, {**values, name: choice}) for choice in choices]
            for env, values in vectors:
                if values.get("SFT") == "true" or env.get("MP_DATASET_TYPE") == "raw":
                    jobs.append(({**env, "MP_SFT_PACKING": "true"}, values))
        seen: set[str] = set()
        for env, values in jobs:
            args = []
            for name in names:
                value = values[name]
                if name == "DATASET_PATH":
                    value = str(work / "data" / ("train.json" if env.get("MP_DATASET_TYPE") == "raw"
                                                 else "mmap_text_document"))
                elif name == "VALID_DATASET_PATH":
                    value = str(work / "data" / ("valid.json" if env.get("MP_DATASET_TYPE") == "raw"
                                                 else "mmap_text_document"))
                elif name == "PRETRAIN_CHECKPOINT_PATH":
                    value = str(work / "ckpt")
                elif name == "OUTPUT_BASEPATH":
                    value = str(work / "out")
                args.append(value)
            for call in run_script(folder, script, args, env, work):
                program = next(i for i, token in enumerate(call) if token.endswith(".py"))
                argv = placeholders(call[program + 1:], work)
                key = json.dumps([script, argv])
                if key in seen:
                    continue
                seen.add(key)
                shown = [("{DATA}" if n == "DATASET_PATH" or n == "VALID_DATASET_PATH" else
                          "{CKPT}" if n == "PRETRAIN_CHECKPOINT_PATH" else "{OUT}" if n == "OUTPUT_BASEPATH"
                          else a) for n, a in zip(names, args, strict=True)]
                launcher = placeholders(call[:program], work)
                launcher = ["{MASTER_PORT}" if i and launcher[i - 1] == "--master_port" else token
                            for i, token in enumerate(launcher)]  # the scripts draw it at random
                runs.append({"script": script, "args": " ".join(shown), "env": env,
                             "launcher_argv": launcher, "entry": call[program],
                             "argv": argv})
        print(f"{script}: {sum(r['script'] == script for r in runs)} argvs")
    return runs


def compact(runs: list[dict]) -> list[dict]:
    """Each script's later argvs as edits of its first (difflib opcodes: [start, end, tokens] replace
    base[start:end]); tests/compat/pai_sweep.py's `expand` undoes it, and this checks that it does."""
    from difflib import SequenceMatcher

    base: dict[str, list[str]] = {}
    out = []
    for run in runs:
        argv = run["argv"]
        if run["script"] not in base:
            base[run["script"]] = argv
            out.append(run)
            continue
        first = base[run["script"]]
        edits = [[i1, i2, argv[j1:j2]] for op, i1, i2, j1, j2 in
                 SequenceMatcher(None, first, argv, autojunk=False).get_opcodes() if op != "equal"]
        rebuilt = list(first)
        for start, end, tokens in reversed(edits):
            rebuilt[start:end] = tokens
        assert rebuilt == argv
        entry = {key: value for key, value in run.items() if key != "argv"}
        out.append({**entry, "edits": edits})
    return out


def main(git_dir: str) -> None:
    commit = subprocess.run(["git", "-C", git_dir, "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    archive = subprocess.run(["git", "-C", git_dir, "archive", commit, "examples"], capture_output=True,
                             check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tree"
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(folder, filter="data")
        runs = sweep(folder, Path(tmp) / "w")
    dates = {script: subprocess.run(["git", "-C", git_dir, "log", "-1", "--format=%ad", "--date=short", commit,
                                     "--", script], capture_output=True, text=True).stdout.strip()
             for script in SCRIPTS}
    header = {"source": "alibaba/Pai-Megatron-Patch", "commit": commit, "dates": dates,
              "about": "argv that each launch script hands to torchrun; see tests/compat/pai_sweep_extract.py"}
    lines = [json.dumps(header)] + [json.dumps(run) for run in compact(runs)]
    OUT.write_text("[\n" + ",\n".join(lines) + "\n]\n")
    print(f"{len(runs)} argvs -> {OUT}")


if __name__ == "__main__":
    os.environ.setdefault("LC_ALL", "C")
    main(sys.argv[1])
