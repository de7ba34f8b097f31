"""Training data: corpora read from disk, the byte-level BPE tokenizer, fixed-length batches."""
