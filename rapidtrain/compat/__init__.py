"""Megatron-LM's and PAI-Rapidformer's meanings on top of rapidtrain: their flags' leniencies and
translations (`flags`), and the user-code API their scripts import (`mpu`, `megatron`, `rapidformer`).

Nothing here is imported by `import rapidtrain`; the public names load lazily from `rapidtrain/__init__.py`.
"""
