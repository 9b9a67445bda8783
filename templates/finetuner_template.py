"""Finetuner template (Rapidformer's shape): copy this file, change the four hooks, run it with

    rapidtrain --user-script finetuner_template.py \
        --pretrained-model-name-or-path MODEL_DIR --data-dir DATA_DIR --data-name sst2 \
        --epochs 3 --micro-batch-size 16 --global-batch-size 32 --lr 2e-5 [--mixed-precision]
        [--zero-2-memory-optimization | --fsdp-memory-optimization | ...] [--data-iterator dynamic-shape]

A Rapidformer script runs unchanged but for its import line (`from rapidformer import ...` becomes
`from rapidtrain import ...`). Everything is local: the model folder and GLUE-style files
(DATA_DIR/NAME/train.tsv, dev.tsv with `sentence` and `label` columns, as examples/glue_classification
writes them). rapidtrain wraps the model per the flags (DDP, ZeRO, FSDP, mixed precision, activation
checkpointing, torch.compile), shares the data out over the data-parallel ranks, accumulates gradients
when --global-batch-size asks for it, evaluates after every epoch and, with --save, writes SAVE/best/ and
SAVE/last/ (loadable with `from_pretrained`) and resumable checkpoints (--load).
"""

import os

import datasets
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rapidtrain import Finetuner, RapidformerEngine, get_args


def extra_args_provider(parser):
    """Flags of your own (optional): add a group and return the parser."""
    group = parser.add_argument_group("my task")
    group.add_argument("--text-column", default="sentence", help="Column holding the text to classify.")
    return parser


class MyFinetuner(Finetuner):
    def __init__(self, engine):
        super().__init__(engine=engine)

    def train_valid_test_datasets_provider(self):
        """→ (train, valid, test, collate_fn): map-style datasets (or lists) and how to batch their items."""
        args = get_args()
        tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path, local_files_only=True)
        self.tokenizer = tokenizer  # saved beside the model in SAVE/best and SAVE/last
        folder = os.path.join(args.data_dir, args.data_name)
        files = {"train": os.path.join(folder, "train.tsv"), "validation": os.path.join(folder, "dev.tsv")}
        raw = datasets.load_dataset(
            "csv", data_files=files, delimiter="\t", quoting=3
        )  # 3: no quoting (GLUE)

        def tokenize_function(examples):
            return tokenizer(examples[args.text_column], truncation=True, max_length=args.seq_length)

        tokenized = raw.map(tokenize_function, batched=True, remove_columns=[args.text_column])
        tokenized = tokenized.rename_column("label", "labels")

        def collate_fn(examples):
            return tokenizer.pad(examples, padding="longest", return_tensors="pt")

        return tokenized["train"], tokenized["validation"], None, collate_fn

    def model_optimizer_lr_scheduler_provider(self):
        """→ (model, optimizer, scheduler); None, None: built from --optimizers/--lr and --lr-decay-style."""
        args = get_args()
        model = AutoModelForSequenceClassification.from_pretrained(
            args.pretrained_model_name_or_path, num_labels=2, local_files_only=True
        )
        return model, None, None

    def run_forward_step(self, batch, model):
        """One micro-batch (already on the device) → its loss."""
        output_tensor = model(**batch)
        return output_tensor.loss

    def run_compute_metrics(self, model, eval_dataloader):
        """After every epoch: every validation sample once; self.gather(t) collects t from all ranks."""
        model = model[0]
        correct = total = 0
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions = self.gather(outputs.logits.argmax(dim=-1))
            references = self.gather(batch["labels"])
            correct += int((predictions == references).sum())
            total += len(references)
        return {"accuracy": correct / max(total, 1)}


if __name__ == "__main__":
    engine = RapidformerEngine(extra_args_provider=extra_args_provider)
    trainer = MyFinetuner(engine=engine)
    trainer.train()
