"""The batch kind: static batches of equal-length sequences (`kind: batch`)."""
