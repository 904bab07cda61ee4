"""Hugging Face integrations: an Accelerate accelerator and a Trainer."""
