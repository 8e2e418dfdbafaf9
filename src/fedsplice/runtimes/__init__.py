"""Runtimes: what carries the round loop's fit and evaluate calls to the clients. `inprocess`
(one process, or `workers` worker processes) and `flower` (Flower's deployment engine); each
implements federation's transport calls, and federation knows none of them."""
