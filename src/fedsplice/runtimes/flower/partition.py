"""Which SuperNode serves which client (`owned`: cid % num-partitions == partition-id), and the
fingerprint by which the server checks that a SuperNode built the same partition as it did."""

from __future__ import annotations

import hashlib

from fedsplice.federation import Experiment


def client_fingerprint(exp: Experiment, cid: int) -> str:
    """A hash of a client's training and local test data, so the server can tell that a
    SuperNode built the same partition as it did (same data, same seed)."""
    d, c = exp.data, exp.clients[cid]
    h = hashlib.sha256()
    for i in c.train_idx.tolist():
        h.update(d.train_texts[i].encode())
        h.update(b"\x00%d\x01" % int(d.train_labels[i]))
    h.update(b"|")
    for i in c.test_idx.tolist():
        h.update(d.test_texts[i].encode())
        h.update(b"\x00%d\x01" % int(d.test_labels[i]))
    return h.hexdigest()


def owned(cid: int, partition_id: int, num_partitions: int) -> bool:
    return cid % num_partitions == partition_id
