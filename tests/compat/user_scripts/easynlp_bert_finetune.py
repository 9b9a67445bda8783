"""A user's text-classification fine-tuning in the shape of EasyNLP's Rapidformer example (a Finetuner subclass
that picks its Hugging Face model by --app-name and reads --user-defined-parameters), written against rapidtrain.
EasyNLP's application zoo is replaced by transformers' Auto classes over a local folder; the data are JSON lines
(train.jsonl, dev.jsonl) under --data-dir/--data-name."""

import os

import torch
from datasets import load_dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rapidtrain import Finetuner, RapidformerEngine, get_args

MODEL_OF_APP = {"text_classify": AutoModelForSequenceClassification}


def user_parameters(text):
    """'key=value key2=value2' → dict (quotes a launch script kept around it dropped)."""
    return dict(item.split("=", 1) for item in (text or "").strip("'\"").split() if "=" in item)


class TextClassification(Finetuner):
    def train_valid_test_datasets_provider(self):
        args = get_args()
        tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path)
        folder = os.path.join(args.data_dir, args.data_name)
        raw = load_dataset("json", data_files={"train": f"{folder}/train.jsonl", "dev": f"{folder}/dev.jsonl"})
        encoded = raw.map(lambda rows: tokenizer(rows["sentence"], truncation=True, max_length=args.seq_length),
                          batched=True, remove_columns=["sentence"]).rename_column("label", "labels")
        encoded.set_format("torch")

        def pad(rows):
            return tokenizer.pad(rows, return_tensors="pt")

        return encoded["train"], encoded["dev"], encoded["dev"], pad

    def model_optimizer_lr_scheduler_provider(self):
        args = get_args()
        folder = user_parameters(args.user_defined_parameters).get("pretrain_model_name_or_path")
        folder = folder if folder and os.path.isdir(folder) else args.pretrained_model_name_or_path
        return MODEL_OF_APP[args.app_name].from_pretrained(folder), None, None

    def run_forward_step(self, batch, model):
        return model(**batch).loss

    def run_compute_metrics(self, model, eval_dataloader):
        hits = []
        for batch in eval_dataloader:
            with torch.no_grad():
                predicted = model[0](**batch).logits.argmax(-1)
            hits.append(self.gather((predicted == batch["labels"]).float()))  # every rank's rows, padding dropped
        return {"accuracy": float(torch.cat(hits).mean())}


if __name__ == "__main__":
    TextClassification(engine=RapidformerEngine()).train()
