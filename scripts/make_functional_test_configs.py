"""Write tests/compat/functional_test_configs.json: every training configuration of Megatron-LM's functional tests
(tests/functional_tests/test_cases/**/model_config.yaml) as the argv its CI passes, for the sweep in
tests/compat/test_functional_configs.py.

    python scripts/make_functional_test_configs.py /path/to/Megatron-LM/.git [--commit REV ...]

The data holds every configuration of 2026-08-22 (d98e8a64) and those of 2025-07-01 (805f3b8d) that pass a flag none
of 2026 does: `--commit 805f3b8d --commit d98e8a64`.

A configuration's MODEL_ARGS (and MODEL_ARGS_2, ... of checkpoint-consistency tests) becomes flags as Megatron's
tests/functional_tests/shell_test_utils/_run_training.sh makes them: `true` a bare flag, `[a b]` the words a and b,
any other value one word; `${NAME}` placeholders become `{NAME}` (tests/compat/launch_data.py fills them). The
world size is the recipe's nodes × GPUs (tests/test_utils/recipes), or the test's own GPUS_PER_NODE. Inference,
RL and NeMo tests are left out: they run other programs than the training entry points.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parents[1] / "tests" / "compat" / "functional_test_configs.json"
CASES = re.compile(r"tests/functional_tests/test_cases/(?P<family>[^/]+)/(?P<case>[^/]+)/model_config\.yaml")
# The entry program of a family whose recipe does not name one.
FAMILY_ENTRY = {"gpt": "pretrain_gpt.py", "moe": "pretrain_gpt.py", "mixtral": "pretrain_gpt.py",
                "bert": "pretrain_bert.py", "t5": "pretrain_t5.py", "hybrid": "pretrain_hybrid.py",
                "nemotron": "pretrain_hybrid.py", "multimodal-llava": "pretrain_vlm.py",
                "mimo": "examples/mimo/train.py"}


class _TextLoader(yaml.SafeLoader):
    """YAML with numbers kept as written ('.01', '1e-2'), as yq hands them to the shell; booleans and merges stay."""


_TextLoader.add_constructor("tag:yaml.org,2002:int", lambda loader, node: loader.construct_scalar(node))
_TextLoader.add_constructor("tag:yaml.org,2002:float", lambda loader, node: loader.construct_scalar(node))


def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=True).stdout


def argv_of(model_args: dict) -> list[str]:
    """_run_training.sh's rule: true → the bare flag; '' → nothing; [a b] → its words; anything else → one word."""
    argv: list[str] = []
    for flag, value in model_args.items():
        text = "true" if value is True else "false" if value is False else str(value).strip()
        if text == "":
            continue
        text = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: "{" + (m.group(1) or m.group(2)) + "}", text)
        # a path under a placeholder keeps its file name only (what launch_data.localize reads: .json, .txt, .model,
        # _text_sentence ...): CI's folders are not facts a local run can use
        text = re.sub(r"^(\{\w+\})/(?:[^\s/]+/)+([^\s/]+)$", r"\1/\2", text)
        if text == "true":
            argv.append(flag)
        elif re.fullmatch(r"\[[^]]+\]", text):
            argv += [flag, *text[1:-1].split()]
        else:
            argv += [flag, text]
    return argv


def recipes(repo: str, commit: str) -> dict[str, tuple[int, int, str | None]]:
    """test case → (nodes, GPUs per node, training script) from the CI recipes; H100's first, then the largest."""
    found: dict[str, list[tuple[int, int, int, str | None]]] = {}
    for path in git(repo, "ls-tree", "-r", "--name-only", commit, "tests/test_utils/recipes").split():
        if not path.endswith(".yaml"):
            continue
        recipe = yaml.safe_load(git(repo, "show", f"{commit}:{path}"))
        spec = recipe.get("spec") if isinstance(recipe, dict) else None
        if not spec:
            continue
        script = re.search(r"TRAINING_SCRIPT_PATH=([\w./-]+\.py)", spec.get("script") or "")
        rank = 0 if "/h100/" in path else 1
        for product in recipe.get("products") or []:
            for case in product.get("test_case") or []:
                found.setdefault(case, []).append((rank, -int(spec.get("nodes") or 1) * int(spec.get("gpus") or 8),
                                                   int(spec.get("nodes") or 1), script and script.group(1)))
    out = {}
    for case, choices in found.items():
        _, world, nodes, script = sorted(choices, key=lambda c: (c[0], c[1]))[0]
        out[case] = (nodes, -world // nodes, script)
    return out


def configs(repo: str, commit: str) -> list[dict]:
    date = git(repo, "show", "-s", "--format=%cs", commit).strip()
    layouts = recipes(repo, commit)
    out = []
    for path in git(repo, "ls-tree", "-r", "--name-only", commit, "tests/functional_tests/test_cases").split():
        match = CASES.fullmatch(path)
        if not match:
            continue
        config = yaml.load(git(repo, "show", f"{commit}:{path}"), Loader=_TextLoader)
        family, case = match["family"], match["case"]
        if not isinstance(config, dict) or config.get("MODE") in ("inference", "rl") or family == "gpt-nemo":
            continue
        nodes, per_node, script = layouts.get(case, (1, 8, None))
        entry = script or FAMILY_ENTRY.get(family, "pretrain_gpt.py")
        own_gpus = config.get("MODEL_ENV_VARS") or {}
        for key in sorted((k for k in config if re.fullmatch(r"MODEL_ARGS(_\d+)?", k)),
                          key=lambda k: int(k.rsplit("_", 1)[1]) if k[-1].isdigit() else 1):
            model_args = config[key]
            if not isinstance(model_args, dict) or not all(str(flag).startswith("--") for flag in model_args):
                continue
            gpus = int((own_gpus.get(key) or {}).get("GPUS_PER_NODE") or per_node)
            suffix = "" if key == "MODEL_ARGS" else "-" + key.rsplit("_", 1)[1]
            out.append({"id": f"{family}/{case}{suffix}", "path": path, "commit": commit, "date": date,
                        "entry": Path(entry).name, "nodes": nodes, "gpus_per_node": gpus,
                        "argv": argv_of(model_args)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repo", help="a Megatron-LM git directory (a bare one will do)")
    parser.add_argument("--commit", action="append", help="commits to read, oldest first (default HEAD): all of the "
                        "last; of an earlier one, for each flag no later configuration passes, the first that does")
    options = parser.parse_args()
    commits = [git(options.repo, "rev-parse", rev).strip() for rev in options.commit or ["HEAD"]]
    kept = configs(options.repo, commits[-1])
    for commit in reversed(commits[:-1]):
        known = {token for config in kept for token in config["argv"] if token.startswith("--")}
        for config in configs(options.repo, commit):
            flags = {token for token in config["argv"] if token.startswith("--")}
            if flags - known and config["id"] not in {c["id"] for c in kept}:
                kept.append(config)
                known |= flags
    kept.sort(key=lambda c: (c["date"], c["id"]), reverse=False)
    OUT.write_text("[\n" + ",\n".join(json.dumps(c, ensure_ascii=False, separators=(",", ":")) for c in kept)
                   + "\n]\n")
    print(f"{OUT}: {len(kept)} configurations")


if __name__ == "__main__":
    main()
