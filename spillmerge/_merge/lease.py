"""One merge per output: a lease taken before the first byte of output is written, checked before
every destructive step (docs/GUARANTEES.md, "One merge per output"; docs/FORMAT.md): ``flock`` on
local disks, conditional-PUT objects renewed by a heartbeat on object stores."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from types import TracebackType

from .._errors import CorruptSpillError, LeaseLostError, OutputBusyError, SpillStorageError
from .._format import common as F
from .._storage import Storage

LEASE_DIR = "spillmerge-lease"
DEFAULT_TTL = 120.0
"""Seconds an object-store lease stays valid without a heartbeat (renewed every quarter of it)."""
_OUTPUT = "output"
"""The lock every holder takes: exclusively for a whole merge, shared for parts and finalize."""
_MAX_RECORD = 64 << 10
_ATTEMPTS = 40
"""Tries of a local lease before a lock held by no one who says so makes the output busy (~1.5 s)."""


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds (or held) a lease: written into the lease and into the completion marker."""

    owner: str
    """A random token of this acquisition."""
    role: str
    """``merge``, ``part I/N`` or ``finalize``."""
    host: str
    """Host name of the holding process."""
    pid: int
    """Process id on that host."""
    since: str
    """When the lease was taken (UTC, ISO 8601)."""
    expires: float
    """Unix time after which an object-store lease may be taken over (0: held by a lock)."""

    def describe(self) -> str:
        until = ""
        if self.expires:
            left = self.expires - time.time()
            until = f", expires in {left:.0f} s" if left > 0 else f", expired {-left:.0f} s ago"
        return f"{self.role} (pid {self.pid} on {self.host}, since {self.since}{until})"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode("utf-8")

    @classmethod
    def from_json(cls, raw: bytes) -> Holder | None:
        """The holder a lease object names, or None when it is empty or not a lease (torn write)."""
        types = {"owner": str, "role": str, "host": str, "pid": int, "since": str, "expires": float}
        try:
            obj = json.loads(raw)
            return cls(**{k: t(obj[k]) for k, t in types.items()})
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


def _read_holder(output: Storage, rel: str) -> Holder | None:
    """The holder the lease object ``rel`` names; None when it is absent, empty or torn."""
    raw = output.get_or_none(rel, max_bytes=_MAX_RECORD)
    return None if raw is None else Holder.from_json(raw)


def _locked(fd: int) -> bool:
    """Whether another process holds a lock on ``fd`` (probed with a shared lock, dropped at once)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


class Lease:
    """A held lease on an output; see the module docstring."""

    def __init__(self, output: Storage, *, name: str, role: str, exclusive: bool) -> None:
        """Take the lease ``name`` (``merge``, ``part-00001-of-00004``, ``finalize``) or raise
        :class:`OutputBusyError` naming every holder in the way."""
        self.output, self.name, self.exclusive = output, name, exclusive
        self.holder = Holder(
            owner=uuid.uuid4().hex,
            role=role,
            host=socket.gethostname(),
            pid=os.getpid(),
            since=F.utcnow(),
            expires=0.0,
        )
        self._fds: dict[str, int] = {}  # lock-file rel path -> fd (local flock mode)
        self._objects: list[str] = []  # lease objects we created (object-store mode)
        self._lost: str | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        if not (output.local and self._acquire_flock()):
            output.makedirs(LEASE_DIR)
            self._acquire_object()

    # ------------------------------------------------------------------------------ acquire
    def _open_lock(self, rel: str) -> int | None:
        """An fd of the lock file ``rel`` (created if absent), or None when its folder is gone: a
        finishing holder tidied the lease folder away just now (the caller starts over)."""
        p = self.output.path(rel)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK  # a link is refused, a FIFO never waited on
        try:
            fd = os.open(p, flags, 0o644)
        except FileNotFoundError:
            return None
        except OSError as exc:
            where = self.output.describe(rel)
            raise SpillStorageError(f"cannot open the lease file {where}: {exc.strerror}", path=where) from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # storage is untrusted (docs/GUARANTEES.md, threat model)
            os.close(fd)
            where = self.output.describe(rel)
            raise CorruptSpillError(
                f"{where} is not a regular file: not a lease file spillmerge wrote; remove it if no merge is running",
                path=where,
            )
        return fd

    def _acquire_flock(self) -> bool:
        """Local disks: flock the holder's own file, then the output's. False when the filesystem
        has no working flock (the caller falls back to lease objects).

        A finishing holder tidies the lease folder away (``release(tidy=True)``): for that moment it
        holds the output's lock exclusively and then unlinks the files. Neither is a conflict: an
        attempt that meets one starts over, and only a holder that is still there after
        ``_ATTEMPTS`` tries, or one whose record names it, makes the output busy."""
        for attempt in range(_ATTEMPTS):
            if attempt:
                time.sleep(min(0.005 * attempt, 0.05))
            try:
                os.makedirs(self.output.path(LEASE_DIR), exist_ok=True)
            except FileExistsError:
                pass  # made, then tidied away by a finishing holder between two steps of makedirs: retried
            except OSError as exc:
                where = self.output.describe(LEASE_DIR)
                raise SpillStorageError(f"cannot create {where}: {exc.strerror}", path=where) from exc
            outcome = self._flock_all()
            if outcome is False:
                return False
            if isinstance(outcome, list):
                if outcome:
                    raise self._busy(outcome)
                continue  # a lock file vanished, or locked by no one who says so: a holder tidying up, or one starting
            if self._still_linked() is None:
                return True
            # We locked a file an exclusive holder removed while tidying up (between our open and
            # our flock): the lock means nothing. Try again on the files that are there now.
            self.release()
        raise self._busy([])

    def _flock_all(self) -> bool | list[Holder]:
        """True: both locks held. False: no working flock here. A list: blocked, by these holders
        (empty, retried: by none that says so, or a lock file vanished under us)."""
        mine, shared = f"{LEASE_DIR}/{self.name}.lock", f"{LEASE_DIR}/{_OUTPUT}.lock"
        for rel, exclusive in ((mine, True), (shared, self.exclusive)):
            fd = self._open_lock(rel)
            if fd is None:
                self.release()
                return []
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                self.release()
                # In our way: our name's holder; on the output's lock, a whole merge blocks everyone
                # and a part or a finalize blocks only a whole merge.
                named = None if self.exclusive else {f"{_MERGE}.lock"}
                return self._local_holders({f"{self.name}.lock"} if rel == mine else named)
            except OSError as exc:
                os.close(fd)
                self.release()
                if exc.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    return False
                where = self.output.describe(rel)
                raise SpillStorageError(f"cannot lock {where}: {exc.strerror}", path=where) from exc
            self._fds[rel] = fd
            if rel == mine:  # who holds it, for the next process's error message
                data = self.holder.to_json()
                os.ftruncate(fd, 0)
                os.pwrite(fd, data, 0)
        return True

    def _local_holders(self, names: set[str] | None = None) -> list[Holder]:
        """The holders of the lock files under the lease folder (of ``names`` only, if given)
        that are locked right now."""
        out = []
        for fname in self.output.listdir(LEASE_DIR):
            if not fname.endswith(".lock") or fname == f"{_OUTPUT}.lock":
                continue
            if names is not None and fname not in names:
                continue
            rel = f"{LEASE_DIR}/{fname}"
            if rel in self._fds:
                continue
            fd = self._open_lock(rel)
            if fd is None:
                continue  # tidied away: nobody holds it
            try:
                if not _locked(fd):
                    continue  # nobody holds it: a finished holder's file
                for attempt in range(21):  # locked a moment ago, its record not written yet
                    holder = Holder.from_json(os.pread(fd, _MAX_RECORD, 0))
                    if holder is not None or attempt == 20:
                        break
                    time.sleep(0.025)
            finally:
                os.close(fd)
            if holder is not None:
                out.append(holder)
        return out

    def _acquire_object(self) -> None:
        """Object stores: create our lease object conditionally, then look for holders it
        conflicts with; on a conflict remove ours again (both may back off; neither proceeds)."""
        rel = f"{LEASE_DIR}/{self.name}.json"
        self.holder = replace(self.holder, expires=time.time() + DEFAULT_TTL)
        if not self.output.create(rel, self.holder.to_json()):
            old = _read_holder(self.output, rel)
            if old is None:  # being written this instant (a local O_EXCL create) or damaged by hand
                raise self._busy([])
            if old.expires > time.time():
                raise self._busy([old])
            # Expired: its holder died or hung. Take it over (of two takers, create lets one win).
            self.output.rm_tree(rel)
            if not self.output.create(rel, self.holder.to_json()):
                raise self._busy([h for h in [_read_holder(self.output, rel)] if h is not None])
        self._objects.append(rel)
        blocking = []
        for fname in self.output.listdir(LEASE_DIR):
            other = f"{LEASE_DIR}/{fname}"
            if not fname.endswith(".json") or other == rel:
                continue
            if not self.exclusive and fname != f"{_MERGE}.json":
                continue  # parts and finalize share the output
            holder = _read_holder(self.output, other)
            if holder is not None and holder.expires > time.time():
                blocking.append(holder)
        if blocking:
            self.release()
            raise self._busy(blocking)
        self._beat = threading.Thread(target=self._heartbeat, name="spillmerge-lease", daemon=True)
        self._beat.start()

    def _object_lost(self) -> str | None:
        """Why our lease object is no longer ours, or None while it is."""
        current = _read_holder(self.output, self._objects[0])
        if current is None or current.owner != self.holder.owner:
            return "it was removed" if current is None else f"it was taken over by {current.describe()}"
        return None

    def _heartbeat(self) -> None:
        rel = self._objects[0]
        while not self._stop.wait(DEFAULT_TTL / 4):
            try:
                self._lost = self._object_lost()
                if self._lost is not None:
                    return
                self.holder = replace(self.holder, expires=time.time() + DEFAULT_TTL)
                self.output.put_atomic(rel, self.holder.to_json())  # never torn for a reader
            except Exception:  # noqa: BLE001 - a transient failure: the next beat retries
                continue

    def _busy(self, holders: list[Holder]) -> OutputBusyError:
        who = "; ".join(h.describe() for h in holders) or (
            f"another process (its lease record under {self.output.describe(LEASE_DIR)} is being written, or is "
            "damaged: remove it if no merge is running)"
        )
        return OutputBusyError(
            f"{self.output.describe()} is being written by {who}: one merge per output. Wait for it to finish, or "
            "choose another out= (--out)"
            + (" (a lease of a process that died expires by itself)" if not self.output.local else ""),
            path=self.output.describe(),
            holders=[h.describe() for h in holders],
        )

    # -------------------------------------------------------------------------------- hold
    def _still_linked(self) -> str | None:
        """None when every file we locked is still the one at its path; else why not."""
        for rel, fd in self._fds.items():
            try:
                same = os.fstat(fd).st_ino == os.stat(self.output.path(rel), follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                return f"{self.output.describe(rel)} was removed or replaced"
        return None

    def check(self) -> None:
        """Raise :class:`LeaseLostError` unless this process still holds the lease. Called before
        every destructive step and before the completion marker."""
        why = self._lost
        if why is None and self._fds:
            why = self._still_linked()
        elif why is None and self._objects:
            why = self._object_lost()
        if why is not None:
            raise LeaseLostError(
                f"{self.holder.role} lost its lease on {self.output.describe()} ({why}); it stopped before changing "
                "anything else. Another merge may be writing this output: check, then run the merge again",
                path=self.output.describe(),
            )

    def release(self, *, tidy: bool = False) -> None:
        """Give the lease up (idempotent); lease objects of ours are removed. ``tidy``: also remove
        the lease folder when nobody else holds a lease (a finished output carries no lock files;
        a process that opened one meanwhile finds it unlinked after locking and starts over)."""
        self._stop.set()
        if self._beat is not None and self._beat is not threading.current_thread():
            self._beat.join()
        shared = f"{LEASE_DIR}/{_OUTPUT}.lock"
        if tidy and shared in self._fds and self._still_linked() is None:
            try:
                fcntl.flock(self._fds[shared], fcntl.LOCK_EX | fcntl.LOCK_NB)  # alone? (SH -> EX)
            except OSError:
                pass  # not alone: the lease folder stays
            else:
                with contextlib.suppress(Exception):  # best effort: lock files are harmless
                    self.output.rm_tree(LEASE_DIR)
        for fd in self._fds.values():
            os.close(fd)  # drops the flock
        self._fds.clear()
        for rel in self._objects:
            with contextlib.suppress(Exception):  # best effort: an unremoved lease expires by itself
                current = _read_holder(self.output, rel)
                if current is not None and current.owner == self.holder.owner:
                    self.output.rm_tree(rel)
        self._objects.clear()

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release(tidy=True)


_MERGE = "merge"
"""The lease name of a whole (one-process) merge."""


def whole(output: Storage) -> Lease:
    """The lease of a one-process merge: exclusive."""
    return Lease(output, name=_MERGE, role="merge", exclusive=True)


def part(output: Storage, i: int, n: int) -> Lease:
    """The lease of part ``i`` of ``n``: shared with other parts and finalize, exclusive by name."""
    return Lease(output, name=f"part-{i:05d}-of-{n:05d}", role=f"part {i}/{n}", exclusive=False)


def held(output: Storage, name: str) -> bool:
    """Whether a live process holds the lease ``name`` right now, as another process sees it: its
    lock file is locked (local disks), or its lease object has not expired (object stores, and
    local file systems without a working flock). Creates, locks for longer than a probe, or
    changes nothing; a lock file that is not a regular file counts as not held."""
    if output.local:
        # (no lock file, or no working flock here: such a holder has a lease object, below)
        with contextlib.suppress(OSError):
            fd = os.open(output.path(f"{LEASE_DIR}/{name}.lock"), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode) and _locked(fd):
                    return True
            finally:
                os.close(fd)
    try:
        holder = _read_holder(output, f"{LEASE_DIR}/{name}.json")
    except (OSError, SpillStorageError, CorruptSpillError):
        return False
    return holder is not None and holder.expires > time.time()


def any_held(output: Storage) -> bool:
    """Whether a live process holds any lease on ``output`` (a merge, a part, a finalize), as :func:`held` sees it."""
    names = {n.rsplit(".", 1)[0] for n in output.listdir(LEASE_DIR) if n.endswith((".lock", ".json"))}
    return any(held(output, name) for name in sorted(names))


def finalize(output: Storage) -> Lease:
    """The lease of a finalize: shared with parts, exclusive with another finalize."""
    return Lease(output, name="finalize", role="finalize", exclusive=False)
