"""`serve -dp`'s KV-event sockets carry every prompt's tokens: they are files in a folder only
its user can enter (0700), each socket 0600, and the folder is gone at exit.

The modes and the owner are the honest test: root (which the tests may run as) passes every
permission check, so a connection refused to another user is shown by a child process that has
become another user (`nobody`) first, where the tests run as root."""

from __future__ import annotations

import os
import socket
import stat

import pytest

from pagedllm.kv_events import KVEventsConfig
from pagedllm.kv_events.publisher import KVEventPublisher
from pagedllm.router.launcher import ipc_endpoints, socket_folder

NOBODY = 65534


def replica_publisher(folder: str) -> KVEventPublisher:
    endpoint, replay = ipc_endpoints(folder, 0)
    config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, replay_endpoint=replay
    )
    return KVEventPublisher(config, 16)


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_socket_folder_is_the_users_alone_and_removed_at_exit():
    with socket_folder() as folder:
        assert not folder.startswith("@"), "not the abstract namespace: it has no permissions"
        assert mode(folder) == 0o700
        assert os.stat(folder).st_uid == os.geteuid()
    assert not os.path.exists(folder)


def test_the_events_and_replay_sockets_are_0600():
    with socket_folder() as folder:
        publisher = replica_publisher(folder)
        try:
            for endpoint in ipc_endpoints(folder, 0):
                path = endpoint.removeprefix("ipc://")
                assert stat.S_ISSOCK(os.stat(path).st_mode)
                assert mode(path) == 0o600
        finally:
            publisher.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user needs root")
def test_another_user_cannot_connect_to_a_replicas_socket():
    with socket_folder() as folder:
        publisher = replica_publisher(folder)
        try:
            path = ipc_endpoints(folder, 0)[0].removeprefix("ipc://")
            pid = os.fork()
            if pid == 0:  # the child: another user, then the connection
                status = 3
                try:
                    os.setgid(NOBODY)
                    os.setuid(NOBODY)
                    with socket.socket(socket.AF_UNIX) as s:
                        s.connect(path)
                    status = 1  # connected: the socket is open to others
                except PermissionError:
                    status = 0
                finally:
                    os._exit(status)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, "another user could connect"
        finally:
            publisher.close()
