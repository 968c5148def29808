"""One writer per output: an exclusive lock held for a run's life (train's run folder; a rank's share of a
caption or dedup folder, which several ranks write at once, each its own).

Two runs writing one ``--output`` interleave ``metrics.jsonl``, prune each other's checkpoints and export
over each other, and a ``--resume`` or ``--overwrite`` started while another run trains there truncates
or deletes what that run is writing; two processes of one rank of a stage write the same files and remove
each other's scratch. So the process takes the folder before it looks at what the folder holds, and a
second one is refused with one line naming the holder:

* on local disk (or a shared file system with POSIX locks), a POSIX record lock (``lockf``) on
  ``RUN/.laionkit-train.lock`` (``.laionkit-<stage>-rank-<N>.lock`` for a stage's rank), which holds the
  holder's pid, host and start time for the message. The
  kernel releases it when the process exits, kill -9 included, so a killed run never blocks its resume.
  Not ``flock``: a flock belongs to the open file, which the forked DataLoader workers share, so it
  outlived a run killed with -9 until its orphaned workers noticed and exited; a POSIX lock belongs to
  the process and is not inherited across fork. (Its one trap: closing *any* descriptor of the file in
  the holding process releases it, so nothing here opens the file twice.)
* in an object store (``--output s3://...``), which has no locks, a lease object
  ``RUN/.laionkit-train.lease`` (JSON: ``owner`` id, ``host``, ``pid``, ``since``, ``expires`` in Unix
  seconds) renewed by a thread every third of its term (``$LAIONKIT_LEASE_SECONDS``, default 300) and
  deleted at the end. A second run refuses an unexpired lease of another owner, except one whose holder
  ran on this host and is no longer alive (a run killed with -9, restarted on its node); an expired
  lease (its run killed elsewhere) is taken over. Taking a lease writes it, waits and reads it back, so
  of two runs starting at once the one whose write landed last wins and the other is refused.

Both names start with a dot: listings skip them and ``--overwrite`` leaves them.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from laionkit.common import LaionkitError
from laionkit.common.storage import Location, one_line_errors

LOCK_NAME = ".laionkit-train.lock"
LEASE_NAME = ".laionkit-train.lease"
SETTLE_SECONDS = 1.0  # between writing a lease and reading it back: longer than two PUTs racing take

_HELD: list = []  # locks and leases of this process, released by release_all (the end of train.run)


def _holder() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _name(stage: str, rank: int | None, suffix: str) -> str:
    return f".laionkit-{stage}{'' if rank is None else f'-rank-{rank}'}.{suffix}"


def _user(stage: str, rank: int | None) -> str:
    return f"another {stage}" + ("" if rank is None else f" as rank {rank}")


def _describe(holder: dict) -> str:
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
            f"started {holder.get('since', '?')}")


def lease_seconds() -> float:
    text = os.environ.get("LAIONKIT_LEASE_SECONDS", "300")
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise LaionkitError(f"LAIONKIT_LEASE_SECONDS={text!r}: a number of seconds > 0")
    return value


class LocalLock:
    """A POSIX lock on RUN/.laionkit-train.lock (a stage's rank: ``.laionkit-<stage>-rank-<N>.lock``); the file
    stays (unlinking it would let a third run lock a new file while the second still holds the old one)."""

    def __init__(self, folder: Path, stage: str = "train", rank: int | None = None) -> None:
        self.folder, self.path, self.fd = Path(folder), Path(folder) / _name(stage, rank, "lock"), None
        self.user = _user(stage, rank)

    def acquire(self) -> None:
        import fcntl

        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise LaionkitError(f"--output {self.folder}: cannot write there ({error.strerror or error})") from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
            except (OSError, ValueError):
                holder = {}
            os.close(fd)
            raise LaionkitError(f"--output {self.folder} is in use by {self.user} ({_describe(holder)}): "
                                "wait for it to end or stop it, or give another --output") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder()).encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the POSIX lock
            self.fd = None


class BucketLease:
    """The lease object of a run folder in an object store (see the module docstring)."""

    def __init__(self, folder: Location, seconds: float | None = None, stage: str = "train",
                 rank: int | None = None) -> None:
        self.folder, self.location = folder, folder / _name(stage, rank, "lease")
        self.user = _user(stage, rank)
        self.seconds = seconds or lease_seconds()
        self.record = {**_holder(), "owner": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> dict | None:
        fs = self.location.fs
        try:
            return json.loads(fs.cat_file(self.location.path))
        except FileNotFoundError:
            return None
        except ValueError:
            return {}  # unreadable: a lease of nobody, taken over

    def _write(self) -> None:
        self.record["expires"] = time.time() + self.seconds
        self.location.fs.pipe_file(self.location.path, json.dumps(self.record).encode())

    def _refuse_other(self, found: dict | None) -> None:
        if not found or found.get("owner") == self.record["owner"]:
            return
        if float(found.get("expires") or 0) <= time.time():
            return  # expired: its run ended without releasing it (killed) and stopped renewing
        if found.get("host") == self.record["host"] and not pid_alive(found.get("pid")):
            return  # its run was on this host and is gone (kill -9): nothing holds it
        left = float(found["expires"]) - time.time()
        raise LaionkitError(f"--output {self.folder} is in use by {self.user} ({_describe(found)}; its lease "
                            f"{self.location} expires in {left:.0f} s unless renewed): wait for it to end or stop "
                            "it, or give another --output")

    def acquire(self) -> None:
        self.location.check_writable()
        with one_line_errors("cannot take the lease", self.location):
            self._refuse_other(self.read())
            self._write()
            time.sleep(SETTLE_SECONDS)
            self._refuse_other(self.read())  # a run that wrote after us holds it
        self._thread = threading.Thread(target=self._renew, name="laionkit-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            try:
                found = self.read()
                if found and found.get("owner") != self.record["owner"]:
                    print(f"warning: the lease {self.location} was taken by {_describe(found)} (this run did "
                          "not renew it in time); stop one of the two runs", flush=True)
                    return
                self._write()
            except Exception as error:  # noqa: BLE001 - a failed renewal is retried at the next interval
                print(f"warning: cannot renew the lease {self.location}: {error}", flush=True)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            with contextlib.suppress(Exception):
                found = self.read()
                if found and found.get("owner") == self.record["owner"]:
                    self.location.fs.rm_file(self.location.path)


def pid_alive(pid) -> bool:
    """Whether a process ``pid`` of this host is alive (a holder killed with -9 is not)."""
    try:
        os.kill(int(pid), 0)
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def hold(lock) -> None:
    """Take ``lock`` (LocalLock or BucketLease) until release_all, or refuse with one line."""
    lock.acquire()
    _HELD.append(lock)


def release_all() -> None:
    while _HELD:
        _HELD.pop().release()


@contextlib.contextmanager
def holding(lock) -> Iterator[None]:
    """``lock`` (LocalLock or BucketLease) taken for the block, or one line refusing it."""
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


def output_lock(output: Location, stage: str, rank: int):
    """The lock of one rank of ``stage`` in ``output``: a POSIX lock on local disk, a lease in a bucket."""
    return LocalLock(Path(output.path), stage, rank) if output.local else BucketLease(output, stage=stage, rank=rank)


@contextlib.contextmanager
def session() -> Iterator[None]:
    """The locks a run takes are released when it ends, however it ends (in this process too)."""
    try:
        yield
    finally:
        release_all()
