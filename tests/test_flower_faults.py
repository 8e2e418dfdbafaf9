"""On Flower, an error that a retry repeats (a config error, a bug) ends the run with that error;
only a fault of the host (memory, network, disk, a node that is gone) counts as a dropout.

The runs go through fedsplice's real ClientApp in this process (test_flower.FakeGrid), which
answers an exception with the same error reply as flwr.supernode.runtime.run_clientapp."""

from __future__ import annotations

import errno

import pytest
from flwr.common.constant import ErrorCode
from test_flower import _lines, in_process  # noqa: F401  in_process: the fixture

from fedsplice.federation.experiment import build
from fedsplice.runtimes.flower import client as flower_client
from fedsplice.runtimes.flower.faults import ClientError, ClientTaskError, classified, fatal_reason, is_fault


def _flower_reason(ex: Exception) -> str:
    return str(type(ex)) + ":<'" + str(ex) + "'>"  # as run_clientapp writes Error.reason


def test_classified_turns_everything_but_host_faults_into_client_task_errors():
    def raising(e):
        @classified
        def handler():
            raise e
        return handler

    with pytest.raises(ClientTaskError, match=r"^ValueError: client 4 is not served$") as got:
        raising(ValueError("client 4 is not served"))()
    assert isinstance(got.value.__cause__, ValueError)
    for fault in (MemoryError(), ConnectionResetError("peer"), TimeoutError(), OSError(errno.ENOSPC, "disk full")):
        with pytest.raises(type(fault)):
            raising(fault)()
    assert not is_fault(FileNotFoundError(errno.ENOENT, "no such file"))  # a wrong data path repeats
    assert not is_fault(KeyError("x")) and is_fault(OSError(errno.EIO, "i/o"))


def test_fatal_reason_reads_flowers_error_reply():
    wrapped = ClientTaskError("ConfigError: peft.rank = 0: use a positive rank")
    assert fatal_reason(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, _flower_reason(wrapped)) == \
        "ConfigError: peft.rank = 0: use a positive rank"
    assert fatal_reason(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, _flower_reason(MemoryError("oom"))) is None
    assert fatal_reason(ErrorCode.NODE_UNAVAILABLE, "node 3 is gone") is None
    assert fatal_reason(ErrorCode.CLIENT_APP_CRASHED, "killed") is None
    assert "could not load fedsplice's ClientApp" in fatal_reason(ErrorCode.LOAD_CLIENT_APP_EXCEPTION, "no module")


def _fail_in_fit(monkeypatch, rnd: int, cid: int, error: Exception):
    real = flower_client.fit_client

    def fit_client(exp, store, c, r, down):
        if (r, c) == (rnd, cid):
            raise error
        return real(exp, store, c, r, down)
    monkeypatch.setattr(flower_client, "fit_client", fit_client)


def test_a_deterministic_client_error_ends_the_flower_run(in_process, cfg_factory, tiny_bert_dir, toy_jsonl,  # noqa: F811
                                                          monkeypatch, tmp_path):
    cfg = cfg_factory(tiny_bert_dir, toy_jsonl, server__rounds="3")
    cid = build(cfg).sampling[1][0]  # a client of round 2
    _fail_in_fit(monkeypatch, 2, cid, KeyError("lora_A.weight"))
    with pytest.raises(ClientError) as got:
        in_process(cfg)
    msg = str(got.value)
    assert f"SuperNode {1000 + cid}, clients [{cid}], train of round 2: KeyError: 'lora_A.weight'" in msg
    assert "\n" not in msg
    events = _lines(tmp_path / "events.jsonl")
    assert [(e["event"], e["round"], e["cids"]) for e in events] == [("client_error", 2, [cid])]


def test_a_host_fault_stays_a_dropout(in_process, cfg_factory, tiny_bert_dir, toy_jsonl, monkeypatch):  # noqa: F811
    cfg = cfg_factory(tiny_bert_dir, toy_jsonl, server__rounds="2", server__max_retries="0")
    s = build(cfg).sampling
    _fail_in_fit(monkeypatch, 1, s[0][0], MemoryError("CUDA out of memory"))
    _, recs, events, _ = in_process(cfg)
    assert [r["round"] for r in recs] == [0, 1, 2]
    assert recs[1]["clients"] == [c for c in s[0] if c != s[0][0]] and recs[1]["dropped"] == 1
    assert recs[2]["clients"] == s[1]
    # one event for the one error reply (not also a "reply_refused"), naming the fault
    assert [(e["event"], e["round"], e["cids"]) for e in events] == [("reply_dropped", 1, [s[0][0]])]
    assert "MemoryError" in events[0]["detail"]
