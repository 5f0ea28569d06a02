"""Many processes: `jax.distributed`, and the loss of one process reported in one line by the others.

A process of a multi-process run that dies (killed, out of memory, its host gone) leaves the others
unable to go on: the next collective has no peer. Left alone they hang in that collective until JAX's
coordination service misses the dead process's heartbeats (50-100 s with its default timeout), then
abort from a C++ thread with a stack, or from Python with a gloo/NCCL error; the coordinator's loss
aborts the others within about 2 s the same way. JAX offers a `missed_heartbeat_callback` to the
client, but in jaxlib 0.10.2 a Python callback cannot be called (its absl::Status argument has no
Python conversion: `std::bad_cast`, then `terminate`), and `jax.distributed.initialize` does not pass
one on; `get_live_nodes` is a barrier of the live processes, not a query.

So each process keeps one TCP connection to process 0, made at start-up (its address goes through the
coordination service's key-value store), and a daemon thread watches them. A process that ends its
run, well or with an error of its own, says so first ("bye"); a connection that closes without it
means the process at the other end died, which its kernel says at once (a host that vanishes is found
by TCP keepalive within about 15 s). The watcher then prints one line naming the lost process, the
step this process reached and the last complete checkpoint, and exits with `EXIT_PEER_LOST`, before
the coordination service would abort; process 0 first tells the others whom it lost. A launcher that
restarts the whole job on a non-zero exit then resumes from that checkpoint, bitwise.
`JAXFORMER_VERBOSE=1` adds the Python stack of an error that the loss caused, if any.
"""

import contextlib
import os
import pathlib
import selectors
import socket
import sys
import threading
import traceback

import jax

EXIT_PEER_LOST = 4  # a process of the run was lost: restart them all, the run resumes from its last checkpoint
VERBOSE_ENV = "JAXFORMER_VERBOSE"
_KEY = "jaxformer/watch"  # process 0's watch address in the coordination service's key-value store
_BYE, _LOST = b"bye", b"lost"

_run: dict = {"step": None, "workdir": None, "error": None, "process": 0, "processes": 1, "done": False}
_conns: dict[int, socket.socket] = {}  # the watched connections, by the process at the other end
_lock = threading.Lock()


def verbose() -> bool:
    """Whether `JAXFORMER_VERBOSE` asks for the Python stack beside the one line.

    Returns:
        True when the variable is set to anything but "" or "0".
    """
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def initialize(address: str | None, num_processes: int | None, process_id: int | None) -> None:
    """`jax.distributed.initialize`, then every process connected to process 0 and watched.

    Args:
        address: the coordinator's host:port, or None for JAX to detect it (SLURM, TPU pods).
        num_processes: the number of processes, or None for JAX to detect it.
        process_id: this process's id, or None for JAX to detect it.
    """
    from jax._src import distributed as jd

    jax.distributed.initialize(coordinator_address=address, num_processes=num_processes, process_id=process_id)
    state = jd.global_state
    _run["process"], _run["processes"] = state.process_id, state.num_processes
    if state.num_processes > 1:
        _connect(state.client, state.process_id, state.num_processes, state.coordinator_address.rsplit(":", 1)[0])
        _orbax_barriers_through_the_coordinator()


def _orbax_barriers_through_the_coordinator() -> None:
    """orbax's barriers by the coordination service's key-value store, not by a psum over every device.

    By default orbax-checkpoint 0.12 syncs processes with `multihost_utils.sync_global_devices`, a device
    computation, and some of its syncs run in its background threads (an async save's finalisation):
    one process can then launch that computation before a training or evaluation step and another after
    it, and two processes that wait on each other's collectives in a different order hang for good (seen
    once in four two-process runs, both processes idle in the final evaluation). Its flag (an absl flag,
    readable once absl's flags count as parsed) makes every barrier `client.wait_at_barrier` instead.
    """
    from absl import flags
    from orbax.checkpoint._src.multihost import multihost  # defines the flag

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()  # a program of the user's that parses absl flags later still may
    flags.FLAGS[multihost.EXPERIMENTAL_ORBAX_USE_DISTRIBUTED_BARRIER.name].value = True


def _keepalive(conn: socket.socket) -> socket.socket:
    """A peer whose host vanished (no FIN ever comes) is found in about 5 + 5 x 2 s."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 5)):
        if hasattr(socket, name):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    return conn


def _connect(client, process_id: int, num_processes: int, host: str) -> None:
    """Process 0 accepts one connection from each other process (whose first line is its id)."""
    if process_id == 0:
        dual = socket.has_dualstack_ipv6()
        server = socket.create_server(
            ("", 0), family=socket.AF_INET6 if dual else socket.AF_INET, dualstack_ipv6=dual, backlog=num_processes
        )
        server.settimeout(300)  # as long as JAX waits for a process at start-up
        client.key_value_set(_KEY, f"{server.getsockname()[1]}")
        for _ in range(num_processes - 1):
            conn, _ = server.accept()
            peer = int(conn.makefile("rb").readline())
            _conns[peer] = _keepalive(conn)
        server.close()
    else:
        port = int(client.blocking_key_value_get(_KEY, 300_000))
        conn = _keepalive(socket.create_connection((host.strip("[]"), port)))
        conn.sendall(f"{process_id}\n".encode())
        _conns[0] = conn
    threading.Thread(target=_watch, name="jaxformer-peer-watch", daemon=True).start()


def _watch() -> None:
    """Wait on the connections; a close without "bye" is a lost process (`_lost` exits)."""
    selector = selectors.DefaultSelector()
    for peer, conn in _conns.items():
        selector.register(conn, selectors.EVENT_READ, peer)
    while selector.get_map():
        for key, _ in selector.select():
            peer = key.data
            try:
                data = key.fileobj.recv(256)
            except OSError:
                data = b""
            if data.startswith(_LOST):  # process 0 lost another process: name that one
                _lost(int(data.split()[1]))
            elif not data:
                _lost(peer)  # returns only once this process has ended its run
            if not data or data.startswith((_BYE, _LOST)):
                selector.unregister(key.fileobj)


def farewell() -> None:
    """Tell the other processes that this one ends on purpose: its closing connections are no loss."""
    with _lock:
        _run["done"] = True
        for conn in _conns.values():
            with contextlib.suppress(OSError):
                conn.sendall(_BYE + b"\n")


def reached(step: int) -> None:
    """Record the step this process has reached, for the line that reports a lost process.

    Args:
        step: the number of steps started so far.
    """
    _run["step"] = step


@contextlib.contextmanager
def watch(workdir: str | pathlib.Path):
    """Around a multi-process run: its end said to the others; a runtime error waits for the watcher.

    A collective whose peer died can fail in Python (gloo's "Connection reset by peer") a moment
    before the watcher has read the closed connection; such an error is held until it has (it
    reports and exits) and raised as it was if no process was lost. Any other end, a return or an
    error of this process's own (a non-finite loss, a full disk), is said to the others first.

    Args:
        workdir: the run's directory, whose last complete checkpoint the report names.

    Yields:
        None.
    """
    _run["workdir"] = pathlib.Path(workdir)
    try:
        yield
    except Exception as e:
        if _conns and _is_runtime_error(e):
            _run["error"] = "".join(traceback.format_exception(e))
            threading.Event().wait(60)  # a closed connection is read at once, a vanished host in ~15 s
        farewell()
        raise
    farewell()


def _is_runtime_error(e: BaseException | None) -> bool:
    while e is not None:
        if isinstance(e, jax.errors.JaxRuntimeError):
            return True
        e = e.__cause__ or e.__context__
    return False


def last_checkpoint(workdir: pathlib.Path | None) -> pathlib.Path | None:
    """The newest complete checkpoint in `workdir` (orbax writes a save in progress to `<step>.orbax-...-tmp`).

    Args:
        workdir: the run's directory, or None.

    Returns:
        workdir/checkpoints/<step> of the highest complete step, or None.
    """
    directory = workdir / "checkpoints" if workdir is not None else None
    steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit()] if directory and directory.is_dir() else []
    return directory / str(max(steps)) if steps else None


def lost_message(lost: int, process_id: int, num_processes: int, step: int | None, workdir) -> str:
    """The one line a survivor prints: who was lost, where this process was, where the run resumes.

    Args:
        lost: the id of the lost process.
        process_id: this process's id.
        num_processes: how many processes the run has.
        step: the last step this process started, or None before the first.
        workdir: the run's directory, or None.

    Returns:
        The line, starting with "error:".
    """
    where = f"step {step}" if step is not None else "no step"
    kept = last_checkpoint(pathlib.Path(workdir) if workdir is not None else None)
    resume = f"the last complete checkpoint is {kept}" if kept is not None else "no checkpoint is complete yet"
    return (
        f"error: lost process {lost} of {num_processes} (it ended without a word: killed or crashed); "
        f"process {process_id} had reached {where}; {resume}; restart all processes with the same command "
        f"to resume (exit code {EXIT_PEER_LOST})"
    )


def _lost(peer: int) -> None:
    """Report the loss of `peer` and exit at once (from the watcher thread).

    `os._exit` skips the interpreter's shutdown, which would wait for the lost process at JAX's
    shutdown barrier; nothing that needs every process (a save, a collective) can finish anyway.
    """
    with _lock:
        if _run["done"]:  # this process has ended its run: connections close as the others end theirs
            return
        try:
            for other, conn in _conns.items():  # process 0 tells the others whom it lost
                if other != peer:
                    with contextlib.suppress(OSError):
                        conn.sendall(_LOST + f" {peer}\n".encode())
            line = lost_message(peer, _run["process"], _run["processes"], _run["step"], _run["workdir"])
            if verbose() and _run["error"]:
                line += "\n" + _run["error"]
            sys.stdout.flush()
            print(line, file=sys.stderr, flush=True)
        finally:
            os._exit(EXIT_PEER_LOST)
