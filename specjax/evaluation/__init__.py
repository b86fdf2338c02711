"""Table 1 in miniature: tasks, metrics, the paired ArS/SpS agreement test, the run."""
