"""A white-box Finetuner in the shape of Rapidformer's EasyNLP example (examples/rapidformer/
rf_finetune_easynlp_bert.py): a Hugging Face model chosen by --app-name and --user-defined-parameters (read from
get_args()), datasets with a padding collate_fn, the batch handed to run_forward_step, metrics gathered from every
rank with self.gather on `model[0]`. Written against rapidtrain; EasyNLP's own application zoo and the hub are not
available here, so transformers' Auto classes and local JSON-lines files stand in for them."""

import os

import torch
from datasets import load_dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rapidtrain import Finetuner, RapidformerEngine, get_args

APPLICATIONS = {"text_classify": AutoModelForSequenceClassification}


def parse_user_defined_parameters(text):
    """EasyNLP's 'key=value key2=value2' string (the launch script's own quotes kept off)."""
    pairs = (item.split("=", 1) for item in (text or "").strip("'\"").split() if "=" in item)
    return {key: value for key, value in pairs}


class EasyNLPFintuner(Finetuner):
    def __init__(self, engine):
        super().__init__(engine=engine)

    def train_valid_test_datasets_provider(self):
        args = get_args()
        tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path)

        def tokenize_function(examples):
            return tokenizer(examples["sentence"], truncation=True, max_length=args.seq_length)

        folder = os.path.join(args.data_dir, args.data_name)
        files = {"train": f"{folder}/train.jsonl", "validation": f"{folder}/dev.jsonl", "test": f"{folder}/dev.jsonl"}
        datasets = load_dataset("json", data_files=files)
        tokenized_datasets = datasets.map(tokenize_function, batched=True, remove_columns=["sentence"])
        tokenized_datasets = tokenized_datasets.rename_column("label", "labels")

        def collate_fn(examples):
            return tokenizer.pad(examples, padding="longest", return_tensors="pt")

        return tokenized_datasets["train"], tokenized_datasets["validation"], tokenized_datasets["test"], collate_fn

    def model_optimizer_lr_scheduler_provider(self):
        args = get_args()
        user_defined_parameters = parse_user_defined_parameters(args.user_defined_parameters)
        application = APPLICATIONS[args.app_name]
        model = application.from_pretrained(user_defined_parameters["pretrain_model_name_or_path"], num_labels=2)
        return model, None, None

    def run_forward_step(self, batch, model):
        label_ids = batch.pop("labels")
        logits = model(**batch).logits
        return torch.nn.functional.cross_entropy(logits, label_ids)

    def run_compute_metrics(self, model, eval_dataloader):
        model = model[0]
        correct = total = 0
        for batch in eval_dataloader:
            label_ids = batch.pop("labels")
            with torch.no_grad():
                predictions = model(**batch).logits.argmax(dim=-1)
            predictions, references = self.gather(predictions), self.gather(label_ids)
            correct += int((predictions == references).sum())
            total += len(references)
        return {"accuracy": correct / max(total, 1)}


if __name__ == "__main__":
    engine = RapidformerEngine()
    trainer = EasyNLPFintuner(engine=engine)
    trainer.train()
