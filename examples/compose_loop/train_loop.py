"""Your own loop with Engine.compose: a small PyTorch text classifier (mean of word embeddings) trained on a
GLUE-style folder (examples/glue_classification/make_data.py writes one).

    rapidtrain --user-script examples/compose_loop/train_loop.py --data-dir WORK/glue --data-name sst2 \
        --epochs 3 --micro-batch-size 16 --global-batch-size 32 --lr 1e-2 [--nproc-per-node 2] [--bf16]

`engine.compose` wraps the model and shares the loaders out over the data-parallel ranks; `engine.backward`
and `engine.step` replace `loss.backward()` and `optimizer.step()` (a step acts once per global batch, so
--global-batch-size above micro × ranks accumulates gradients).
"""

import os

import torch
from torch import nn
from torch.utils.data import DataLoader

from rapidtrain import RapidformerEngine, get_args
from rapidtrain.data.finetune import read_split_file


class BagOfWords(nn.Module):
    def __init__(self, vocab_size: int, dim: int, classes: int) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(vocab_size, dim, mode="mean")
        self.classifier = nn.Linear(dim, classes)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.embedding(ids, offsets))


def main() -> None:
    engine = RapidformerEngine()
    args = get_args()
    folder = os.path.join(args.data_dir, args.data_name)
    train_rows, eval_rows = (read_split_file(os.path.join(folder, f)) for f in ("train.tsv", "dev.tsv"))
    vocab = {w: i + 1 for i, w in enumerate(sorted({w for r in train_rows for w in r["sentence"].split()}))}

    def collate(rows):
        ids = [torch.tensor([vocab.get(w, 0) for w in r["sentence"].split()] or [0]) for r in rows]
        offsets = torch.tensor([0] + [len(i) for i in ids[:-1]]).cumsum(0)
        return {"ids": torch.cat(ids), "offsets": offsets, "labels": torch.tensor([r["label"] for r in rows])}

    model = BagOfWords(len(vocab) + 1, 32, 2)
    train_loader = DataLoader(train_rows, batch_size=args.micro_batch_size, shuffle=True, collate_fn=collate)
    eval_loader = DataLoader(eval_rows, batch_size=args.micro_batch_size, collate_fn=collate)
    model, optimizer, scheduler, train_loader, eval_loader = engine.compose(
        model=model, train_dataloader=train_loader, eval_dataloader=eval_loader
    )
    for epoch in range(args.epochs or 1):
        model.train()
        for batch in train_loader:
            loss = nn.functional.cross_entropy(model(batch["ids"], batch["offsets"]).float(), batch["labels"])
            engine.backward(loss)
            engine.step()
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for batch in eval_loader:
                predictions = eval_loader.gather(model(batch["ids"], batch["offsets"]).argmax(dim=-1))
                references = eval_loader.gather(batch["labels"])
                correct += int((predictions == references).sum())
                total += len(references)
        engine.print_rank0(
            f" epoch {epoch + 1} | loss {loss.item():.4f} | lr {optimizer.param_groups[0]['lr']:.2e} "
            f"| validation accuracy {correct / total:.4f} ({total} samples)"
        )


if __name__ == "__main__":
    main()
