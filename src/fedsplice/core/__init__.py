"""Pure math under everything: the GLOBAL / PRIVATE split, aggregation, robust aggregation and
the server optimizers, the methods' losses and gradient transforms (orthogonality, purification,
temperature-aligned KL, optimal transport), the upload codecs (wire) and
the seeded sampling streams. Tensors in, tensors out: no models, no files, no configs."""
