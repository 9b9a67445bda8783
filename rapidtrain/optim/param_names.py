"""How the optimizers read parameter names, shared by optimizers.py (groups, weight decay) and muon.py (what Muon
takes), which build on each other: kept here so that neither imports the other for them."""

from __future__ import annotations

# MoE experts keep their biases stacked per expert ([E, f], [E, h]): 2-D, yet biases, so no weight decay.
STACKED_BIAS_SUFFIXES = ("experts.b1", "experts.b_gate", "experts.b2")

# Wrappers that prefix parameter names (DDP, torch.compile, activation checkpointing, FairScale).
WRAPPER_NAMES = frozenset({"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
