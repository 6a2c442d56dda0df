"""`vit22b serve --coordinator HOST:PORT --num-processes N --process-id I`: one process of a group.

This process only supervises: it starts the JAX process (``distributed.child_main``) as its child
and says in plain words why it ended. The runtime ends a process that cannot join the group (a
peer that never arrives) or whose coordinator has gone by aborting it (SIGABRT): nothing in
that process can catch it, so its parent reports it. The child dies with its parent. The group
flags are declared once (``GroupSettings``), each with its ``VIT22B_<FLAG>`` variable.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass

from vit22b.clients import settings
from vit22b.clients.settings import at_most, setting

from .settings import DAY, HOUR, ServeConfig

BEAT_S = 0.5  # a worker's heartbeat period; process 0 polls at the same pace
STATUS_FD_ENV = "VIT22B_STATUS_FD"  # where the JAX process reports its phases to its supervisor


@dataclass(frozen=True)
class Group:
    """Where this process stands in the group and how long it waits for the others (jax-free:
    the supervisor holds it; the JAX process gets it with its settings, ``encode_spec``)."""

    coordinator: str  # HOST:PORT of process 0's coordination service
    num_processes: int
    process_id: int
    init_timeout_s: int  # every process must have joined by then (else the runtime aborts)
    peer_timeout_s: float  # a worker silent this long is gone

    @property
    def leader(self) -> bool:
        return self.process_id == 0

    @property
    def workers(self) -> range:
        return range(1, self.num_processes)


def encode_spec(config: ServeConfig, group: Group) -> str:
    """The JAX process's settings and place, as its one argument (``distributed.decode_spec``)."""
    return json.dumps({"config": dataclasses.asdict(config), "group": dataclasses.asdict(group)})


@dataclass
class GroupSettings:
    coordinator: str | None = setting(
        None, "HOST:PORT of process 0's coordination service, the same for all")
    num_processes: int | None = setting(None, "processes in the group")
    process_id: int | None = setting(
        None, "this process, 0..N-1; 0 serves gRPC, the others follow it")
    init_timeout: int = setting(
        300, "seconds every process has to join, else the start-up ends",
        check=at_most(DAY, "a day"))
    peer_timeout: float = setting(
        5.0, "a worker silent this long is gone: process 0 NOT_SERVING",
        check=at_most(HOUR, "an hour"))


_CHILD = "import sys; from vit22b.server.distributed import child_main; child_main(sys.argv[1])"


def add_group_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("several processes, one model (jax.distributed)")
    settings.add_arguments(group, GroupSettings)


def group_from_args(args: argparse.Namespace) -> Group | None:
    """The Group of these flags, or None for a single-process server."""
    flags = settings.from_args(GroupSettings, args)
    given = [flags.coordinator, flags.num_processes, flags.process_id]
    if all(v is None for v in given):
        return None
    if any(v is None for v in given):
        raise ValueError("--coordinator, --num-processes and --process-id go together")
    if not re.fullmatch(r"\S+:[0-9]+", flags.coordinator):
        raise ValueError(f"--coordinator must be HOST:PORT, got {flags.coordinator!r}")
    if flags.num_processes < 2:  # one process: its plan and buckets are a single server's
        raise ValueError(f"--num-processes must be at least 2, got {flags.num_processes} (one "
                         "process serves without --coordinator, --num-processes and "
                         "--process-id)")
    if not 0 <= flags.process_id < flags.num_processes:
        raise ValueError(f"--process-id must be in 0..{flags.num_processes - 1}, got "
                         f"{flags.process_id}")
    settings.check(flags)
    if flags.peer_timeout < 2 * BEAT_S:  # else a live worker between two beats counts as gone
        raise ValueError(f"--peer-timeout must be at least {2 * BEAT_S:g}s (two of a worker's "
                         f"heartbeats, every {BEAT_S:g}s), got {flags.peer_timeout:g}")
    _check_coordinator(flags.coordinator, flags.process_id == 0)
    return Group(
        flags.coordinator,
        flags.num_processes,
        flags.process_id,
        init_timeout_s=flags.init_timeout,
        peer_timeout_s=flags.peer_timeout,
    )


def _check_coordinator(address: str, here: bool) -> None:
    """ValueError when the coordinator's host does not resolve, or (on process 0, which
    listens there on all interfaces) its port is taken: the runtime said neither (a join that
    timed out; a crash, SIGSEGV)."""
    host, _, port = address.rpartition(":")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port))
    except (OSError, UnicodeError) as err:
        raise ValueError(f"--coordinator {address}: cannot resolve {host!r} ({err})") from None
    if not here:
        return
    for family, any_host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is free
            try:
                probe.bind((any_host, int(port)))
            except OSError as err:
                if err.errno != errno.EADDRINUSE:  # e.g. a port below 1024: the runtime's to say
                    return
                raise ValueError(f"--coordinator {address}: port {port} is in use on this host "
                                 f"({err.strerror}); process 0 listens there") from None
        return


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the supervisor dies (Linux prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def supervise(config: ServeConfig, group: Group) -> int:
    """Run the JAX process of this member of the group; its exit status, explained when needed."""
    read_fd, write_fd = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, encode_spec(config, group)],
        pass_fds=(write_fd,),
        env={**os.environ, STATUS_FD_ENV: str(write_fd)},
        preexec_fn=_die_with_parent,
    )
    os.close(write_fd)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    code = child.wait()
    with os.fdopen(read_fd) as status:
        phases = status.read().split()
    message = explain(code, phases[-1] if phases else "starting", group)
    if message is None:
        return 0
    if message:
        print(f"vit22b serve: {message}", file=sys.stderr, flush=True)
    return code if code >= 0 else 128 - code


def explain(code: int, phase: str, group: Group) -> str | None:
    """Why the JAX process ended: None for a clean stop, '' when it already said why."""
    me = f"process {group.process_id} of {group.num_processes}"
    if code == 0 or (phase == "stopped" and group.process_id):
        return None  # a worker told to stop may be aborted as process 0 leaves: that is clean
    if code > 0:
        return ""
    if code != -signal.SIGABRT:
        return f"{me} was ended by {signal.Signals(-code).name}"
    if phase == "starting":
        waited = f"within --init-timeout {group.init_timeout_s}s"
        if group.process_id == 0:
            return (
                f"{me} gave up: not every process joined the group at {group.coordinator} "
                f"{waited}. Start all {group.num_processes} processes with the same --coordinator "
                "and --num-processes, and make the port reachable from every host"
            )
        return (
            f"{me} gave up: it could not join the group at {group.coordinator} {waited}: "
            "process 0 (the coordinator) or another process never arrived"
        )
    if group.process_id:
        return f"{me} was aborted by the JAX runtime: process 0 (the coordinator) is gone"
    return f"{me} was aborted by the JAX runtime (see its log above)"
