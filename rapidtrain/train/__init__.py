"""Training loops: Trainer (the loop), PreTrainer (iteration-based), Finetuner (epoch-based)."""
