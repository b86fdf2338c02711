"""Training: the corpus and its batches (`data`), losses with distillation, the trainer."""
