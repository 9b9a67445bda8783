"""Your own training loop, accelerated by `engine.compose` (Rapidformer's "no trainer" shape). Run it with

    rapidtrain --user-script compose_loop_template.py \
        --pretrained-model-name-or-path MODEL_DIR --data-dir DATA_DIR --data-name sst2 \
        --epochs 3 --micro-batch-size 16 --global-batch-size 32 --lr 2e-5 [--mixed-precision] [--zero-2-...]

`engine.compose(...)` returns the model wrapped per the flags, an optimizer and schedule that step once
per global batch, and data loaders over this rank's share of the data, whose batches arrive on the device.
Each training batch runs inside its micro-batch context: autocast for mixed precision and, before the last
micro-batch of a global batch, no gradient all-reduce. So keep the loop as it was and change two lines:
`loss.backward()` becomes `engine.backward(loss)`, and the loaders go through `compose`. `optimizer.step()`
acts only at the end of a global batch (gradient accumulation), `optimizer.zero_grad()` is left to the
engine, and the schedule advances with each optimizer step (`lr_scheduler.step()` is accepted), so loops
written for plain PyTorch keep working. `engine.step()` does the same as `optimizer.step()`.
"""

import os
from functools import partial

import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

from rapidtrain import RapidformerEngine, get_args
from rapidtrain.data.finetune import read_split_file

engine = RapidformerEngine()
args = get_args()

tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path, local_files_only=True)
model = AutoModelForSequenceClassification.from_pretrained(
    args.pretrained_model_name_or_path, num_labels=2, local_files_only=True
)
folder = os.path.join(args.data_dir, args.data_name)
train_rows = read_split_file(os.path.join(folder, "train.tsv"))
eval_rows = read_split_file(os.path.join(folder, "dev.tsv"))


def collate_fn(rows):
    batch = tokenizer(
        [r["sentence"] for r in rows],
        truncation=True,
        max_length=args.seq_length,
        padding="longest",
        return_tensors="pt",
    )
    batch["labels"] = torch.tensor([r["label"] for r in rows])
    return batch


train_dataloader = DataLoader(
    train_rows, shuffle=True, collate_fn=collate_fn, batch_size=args.micro_batch_size
)
eval_dataloader = DataLoader(
    eval_rows, shuffle=False, collate_fn=collate_fn, batch_size=args.micro_batch_size
)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
steps_per_epoch = len(train_dataloader) // (args.global_batch_size // args.micro_batch_size)  # a rough count
lr_scheduler = partial(
    get_linear_schedule_with_warmup,
    num_warmup_steps=args.lr_warmup_iters,
    num_training_steps=max(steps_per_epoch * (args.epochs or 1), 1),
)

model, optimizer, lr_scheduler, train_dataloader, eval_dataloader = engine.compose(
    model=model,
    train_dataloader=train_dataloader,
    eval_dataloader=eval_dataloader,
    optimizer=optimizer,
    lr_scheduler_fn=lr_scheduler,
)

for epoch in range(args.epochs or 1):
    model.train()
    for batch in train_dataloader:
        outputs = model(**batch)
        loss = outputs.loss
        engine.backward(loss)
        lr_scheduler.step()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    correct = total = 0
    for batch in eval_dataloader:
        with torch.no_grad():
            predictions = model(**batch).logits.argmax(dim=-1)
        # gather: every rank's rows of this batch, each validation sample exactly once over the loop
        predictions, references = eval_dataloader.gather(predictions), eval_dataloader.gather(batch["labels"])
        correct += int((predictions == references).sum())
        total += len(references)
    engine.print_rank0(
        f" epoch {epoch + 1} | last loss {loss.item():.4f} | validation accuracy "
        f"{correct / max(total, 1):.4f}"
    )
