"""Evaluation: validation loss / bits-per-byte and the lm-eval-harness adapter."""
