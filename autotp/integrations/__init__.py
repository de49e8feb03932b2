"""Where autotp meets its users' tools: transformers' Trainer and model methods, TRL, DDP/PEFT guards, gathering.

It may import every dimension, io and the runtime; nothing below imports it.
"""
