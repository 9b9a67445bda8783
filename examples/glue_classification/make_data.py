"""Make a GLUE-style folder and a tiny BERT locally (no network): WORK/glue/sst2/{train,dev,test}.tsv and
WORK/tiny-bert (config, weights, tokenizer). Replace them by your own GLUE copy and pretrained model.

    python examples/glue_classification/make_data.py WORK [--train 512] [--dev 128]
"""

import argparse
from pathlib import Path

from rapidtrain.tasks import toy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--dev", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    folder = toy.write_glue_folder(options.work / "glue", "sst2", options.train, options.dev, options.seed)
    texts = [row["sentence"] for row in toy.sentiment_records(options.train, options.seed)]
    tokenizer = toy.train_tokenizer(texts, options.work / "tokenizer")
    model = toy.save_tiny_model("bert", options.work / "tiny-bert", tokenizer, hidden=64, layers=2, heads=2)
    print(f"data: {folder}\nmodel: {model}")


if __name__ == "__main__":
    main()
