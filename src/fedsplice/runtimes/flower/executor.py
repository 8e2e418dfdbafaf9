"""A warm ClientApp executor for a SuperNode started with `--isolation process`.

Flower's stock executor (SuperExec, `--isolation subprocess`) starts a fresh `flwr-clientapp`
process for every message: for fedsplice that is ~6-10 s of importing torch/transformers and
loading the backbone per message, more than the training itself. This executor does the same
job as SuperExec + flwr-clientapp, in one long-lived process per SuperNode: it claims the
SuperNode's ClientApp tasks over the SuperNode's Runtime API (loopback), pulls the message and
context, calls fedsplice's `client_app` in-process, and pushes the reply and the final task
status — the same calls, in the same order, as `flwr.supernode.runtime.run_clientapp`. The
experiment (model, data) stays loaded between messages; PRIVATE state still lives in the
node's disk store, so nothing about the math or the wire changes.

It only runs fedsplice's own ClientApp: a run whose FAB names any other `clientapp` is refused
with an error reply. It exits when the SuperNode process (`--parent-pid`) is gone.

Built on Flower 1.42 runtime internals (RuntimeHttpClient, pull_task_input, push_message,
push_task_output), hence the exact `flwr==1.42.0` pin. `fedsplice flower up --isolation
subprocess` uses Flower's stock executor instead.

Usage (next to `flower-supernode --isolation process --port 9094 ...`):
    fedsplice flower executor --runtime-api-address 127.0.0.1:9094 --parent-pid <supernode pid>
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

from flwr.app import Error, Message
from flwr.common.config import get_fab_config
from flwr.common.constant import ErrorCode, SubStatus
from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

from fedsplice.runtimes.flower.client import client_app

CLIENTAPP_REF = "fedsplice.runtimes.flower.client:client_app"
log = logging.getLogger("fedsplice.runtimes.flower.executor")


def _client(address: str, interceptors: list) -> RuntimeHttpClient:
    return RuntimeHttpClient.from_server_address(server_address=address, insecure=True, root_certificates=None,
                                                 interceptors=interceptors,
                                                 retry_invoker=make_simple_http_retry_invoker())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_task(address: str, token: str) -> str:
    """Execute one claimed ClientApp task in this process; returns its final sub-status."""
    client = _client(address, [RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                               RuntimeTokenHttpInterceptor(token)])
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    message = context = reply = None
    status, details = SubStatus.FAILED, "ClientApp task failed"
    try:
        message, context, run, fab = pull_task_input(client)
        ref = get_fab_config(fab.content)["tool"]["flwr"]["app"]["components"].get("clientapp")
        if ref != CLIENTAPP_REF:
            raise PermissionError(f"this executor runs only {CLIENTAPP_REF}, the run's app names {ref!r}")
        t0 = time.perf_counter()
        reply = client_app(message=message, context=context)
        log.info("%s message for run %s done in %.1fs", message.metadata.message_type, run.run_id,
                 time.perf_counter() - t0)
        status, details = SubStatus.COMPLETED, ""
    except Exception as ex:  # noqa: BLE001 - becomes an error reply, as flwr-clientapp does
        log.exception("ClientApp raised an exception")
        details = f"{type(ex)}:<'{ex}'>"
        if message is not None:
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
        except Exception:  # noqa: BLE001
            log.exception("failed to push the reply")
            status = SubStatus.FAILED
        push_task_output(client=client, context=context, sub_status=status, details=details)
        heartbeat.stop()
        client.close()
    return status


def run_executor(address: str, parent_pid: int | None = None, poll_s: float = 0.2) -> None:
    """Claim and run the SuperNode's ClientApp tasks until the SuperNode is gone."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import fedsplice.federation  # noqa: F401 - warm up: import torch & co. before the first message

    client = _client(address, [RuntimeVersionHttpInterceptor(component_name="SuperExec")])
    log.info("fedsplice executor serving ClientApp tasks of the SuperNode at %s", address)
    try:
        while parent_pid is None or _pid_alive(parent_pid):
            try:
                res = client.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP],
                                                            agentapp_fab_hashes=[]))
            except Exception as e:  # noqa: BLE001 - the SuperNode may be starting or gone
                log.debug("AcquireTask failed: %s", e)
                time.sleep(1.0)
                continue
            if res.HasField("task") and res.token:
                try:
                    run_task(address, res.token)
                except Exception:  # noqa: BLE001 - one broken task must not take the node down
                    log.exception("task failed outside the ClientApp")
            else:
                time.sleep(poll_s)
    finally:
        client.close()
    log.info("the SuperNode (pid %s) is gone; exiting", parent_pid)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="fedsplice flower executor", description=__doc__.split("\n\n")[0])
    p.add_argument("--runtime-api-address", required=True, help="the SuperNode's Runtime API, host:port")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process (the SuperNode) is gone")
    a = p.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        run_executor(a.runtime_api_address, a.parent_pid)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
