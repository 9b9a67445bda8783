"""Optimizers by `--optimizers` (`optimizers.py`), Megatron's learning-rate schedule in samples (`lr_schedule.py`),
fp16 loss scaling (`grad_scaler.py`), LAMB (`lamb.py`), and the state each optimizer keeps (`state_bytes.py`).

Nothing is imported here: the plan reads the optimizer's choice and state size (`optimizers.resolve_optimizer`,
`state_bytes`) without torch, and importing a module of a package runs its `__init__` first.
"""
