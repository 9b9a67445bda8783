"""`rapidtrain --task T --pretrained-model-name-or-path DIR --data-dir D --data-name N --epochs E ...`: the
black-box fine-tuning of a local Hugging Face model (the `rapidtrain` command starts this file under
torchrun for every task but pretraining).

Tasks: sequence_classification, token_classification, question_answering, masked_lm, casual_lm
(causal_lm), seq2seq_lm (rapidtrain/tasks/). With --save, `SAVE/best/` and `SAVE/last/` hold the model,
tokenizer, `eval_results.json` and the validation predictions; `SAVE/iter_*` resumable checkpoints.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the package importable, not its folder's modules
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from rapidtrain.core.process import exit_after, pause_collection  # noqa: E402

pause_collection(__name__ == "__main__")  # until main starts (rapidtrain/core/process.py)

from typing import Any  # noqa: E402

import torch  # noqa: E402

from rapidtrain.core.errors import user_errors  # noqa: E402
from rapidtrain.train.engine import Engine  # noqa: E402
from rapidtrain.train.finetuner import Finetuner  # noqa: E402


class TaskFinetuner(Finetuner):
    """A Finetuner whose hooks come from the --task's class (data, Auto class, loss, metrics)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        from rapidtrain.tasks import NEEDS_FAST_TOKENIZER, build_task
        from rapidtrain.tasks.base import load_tokenizer, quiet_transformers

        plan, data = engine.plan, engine.plan.data
        quiet_transformers()
        if not data.data_dir and not data.data_name:
            raise SystemExit(
                f"rapidtrain: --task {plan.task} needs its data: --data-dir DIR (GLUE-style .tsv/.csv/.jsonl "
                "split files or a datasets save_to_disk folder) and/or --data-name NAME."
            )
        self.tokenizer = load_tokenizer(plan.checkpoint.pretrained_model, plan.task in NEEDS_FAST_TOKENIZER)
        self.task = build_task(plan.task, self.tokenizer, data.seq_length, plan.switches.dynamic_shape, data.seed,
                               padding_free=data.padding_free)
        from rapidtrain.tasks.language_modeling import MaskedLM

        if isinstance(self.task, MaskedLM):  # the one task that masks tokens
            self.task.mask_prob = data.mask_prob
        self.metric_for_best_model = self.task.best_metric
        self.greater_is_better = self.task.greater_is_better
        self.token_count = self.task.token_count
        self.predictions: list | None = None

    def train_valid_test_datasets_provider(self) -> tuple[Any, Any, Any, Any]:
        from rapidtrain.data.finetune import load_finetune_dataset

        data = self.plan.data
        splits = load_finetune_dataset(data.data_dir, data.data_name)
        if "train" not in splits:
            raise SystemExit(
                f"rapidtrain: the data in --data-dir {data.data_dir} --data-name "
                f"{data.data_name} has no train split (found: {', '.join(splits)}); add train.tsv "
                "(or .csv/.jsonl)."
            )
        prepared = self.task.prepare(dict(splits))
        return prepared["train"], prepared.get("validation"), prepared.get("test"), self.task.collate

    def model_optimizer_lr_scheduler_provider(self) -> tuple[Any, None, None]:
        from rapidtrain.tasks import load_task_model

        plan = self.engine.plan
        compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.precision.dtype, torch.float32)
        # load_tokenizer refused a missing folder in __init__; a Hugging Face fine-tune's plan has LoRA settings.
        assert plan.checkpoint.pretrained_model is not None and plan.lora is not None
        model = load_task_model(self.task, plan.checkpoint.pretrained_model, plan.lora,
                                device=self.engine.device, compute_dtype=compute_dtype,
                                attn_implementation=plan.attention.hf_implementation)
        return model, None, None

    def sample_lengths(self, dataset: Any) -> list[int]:
        return dataset.lengths

    def run_forward_step(self, batch: Any, model: Any) -> Any:
        return self.task.forward(batch, model)

    def run_compute_metrics(self, model: Any, eval_dataloader: Any) -> dict[str, Any]:
        results, self.predictions = self.task.evaluate(model, eval_dataloader, self.gather)
        return results

    def export_files(self, metrics: dict[str, Any]) -> dict[str, Any]:
        files = super().export_files(metrics)
        if self.predictions is not None:
            files["eval_predictions.jsonl"] = [
                {"index": i, "prediction": p} for i, p in enumerate(self.predictions)
            ]
        return files

    def train(self) -> dict[str, Any]:
        results = super().train()
        if self.task.has_labels(self.test_ds) and self.finished():
            test = self.evaluate(self.test_ds)
            shown = " | ".join(f"{k}: {v:.6g}" for k, v in test.items() if isinstance(v, float))
            self.engine.print_rank0(f" test | {shown}")
            results = {**results, **{f"test {k}": v for k, v in test.items()}}
        return results


@user_errors()
def main(argv: list[str] | None = None) -> dict[str, Any]:
    engine = Engine(argv=argv)
    results = TaskFinetuner(engine).train()
    # As pretrain.py: the process group is torn down while every rank is still here, not by interpreter exit.
    engine.shutdown()
    return results


if __name__ == "__main__":
    exit_after(main)  # a rank ends without finalization (rapidtrain/core/process.py)
