"""fedsplice on Flower's deployment engine (flwr 1.42): the only package that imports flwr.

- `app`: the ServerApp (fedsplice's own round loop with a Flower transport) and the ClientApp
  (fedsplice's local update and evaluation on each SuperNode).
- `transport`: `FlowerTransport`, the round loop's fit/evaluate over Flower messages.
- `records`: torch tensors <-> ArrayRecords; the size of a serialized message.
- `certs`: TLS certificates and SuperNode keys with `cryptography`.
- `launcher`: `fedsplice flower up` (SuperLink + SuperNodes on loopback, one run, teardown).

See docs/flower.md.
"""
