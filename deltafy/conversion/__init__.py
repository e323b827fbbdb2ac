"""A conversion, from a source to a checked checkpoint folder: the job (job), the streamed path that
costs a file copy (stream), the self-check of the invariant (verify) and the layer-by-layer check of
a model too large to hold twice (lazy)."""
