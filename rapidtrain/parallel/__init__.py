"""Parallelism applied to models as free functions: mesh, data parallel, DeepSpeed, tensor, pipeline, experts."""
