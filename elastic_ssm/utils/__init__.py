"""Small helpers shared across elastic_ssm that belong to no model, op or training concept.

``files``: atomic file writes (temporary file in the target's directory, fsync, ``os.replace``; mode 0666 less
the umask) and the naming of their temporary files, used by every writer of models, checkpoints, run records,
token files, tokenizer files and caches.
"""
