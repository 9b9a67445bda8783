"""Write tests/compat/launch_scripts.json: real launch scripts of the Megatron family held as data (origin, commit,
date, launcher and its arguments, entry program, the flags passed to it with paths as placeholders {DATA} {VOCAB}
{MERGES} {CKPT} {TOKENIZER_MODEL} {DS_CONFIG} {TENSORBOARD} ..., and the DeepSpeed config it writes).

    python scripts/make_launch_scripts.py /path/to/launch_scripts.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "compat" / "launch_scripts.json"
KEPT = ("id", "origin", "path", "commit", "date", "launcher", "launcher_argv", "entry", "features", "argv",
        "deepspeed_config")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="launch scripts gathered as data (launch_scripts.json)")
    scripts = json.loads(Path(parser.parse_args().source).read_text())
    kept = [{key: script.get(key) for key in KEPT} for script in scripts]
    OUT.write_text("[\n" + ",\n".join(json.dumps(script, ensure_ascii=False) for script in kept) + "\n]\n")
    print(f"{OUT}: {len(kept)} scripts")


if __name__ == "__main__":
    main()
