"""fedsplice on Flower, the application side: the ServerApp (fedsplice's own round loop over a
`FlowerTransport`), `fedsplice flower up` / `app` / `resume`, and the local SuperLink and
SuperNode processes they start. The ClientApp and the wire live in `fedsplice.runtimes.flower`."""
