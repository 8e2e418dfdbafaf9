"""fedsplice on Flower's deployment engine (flwr 1.42): the only package that imports flwr.

- `client`: the ClientApp (fedsplice's local update and evaluation on each SuperNode) and the
  run-config keys.
- `executor`: a warm ClientApp executor for SuperNodes started with `--isolation process`.
- `transport`: `FlowerTransport`, the round loop's fit/evaluate over Flower messages.
- `secagg`: Flower's SecAgg+ for a round (privacy.secure_aggregation): its workflow on the
  server, its client mod on the SuperNodes.
- `faults`: which client errors end the run (a retry repeats them) and which are dropouts.
- `partition`, `nodestate`: which node serves which client; a node's PRIVATE state and snapshots.
- `records`: torch tensors <-> ArrayRecords; the size of a serialized message; JSON-lines logs.
- `certs`: TLS certificates and SuperNode keys with `cryptography`.

The ServerApp, `fedsplice flower up` and resuming live above the runtimes, in `fedsplice.app.flower`.

See docs/flower.md.
"""
