"""The redaction key: where it comes from, where it is kept, how a journal checks it (SPEC 9).

Redacted values are stored as HMAC-SHA256 digests under the redaction key, so the key must
never sit beside the journal: a copied or backed-up journal directory alone must not let
anyone confirm a guessed secret. This module is the only place that reads or writes key
files.

**Where the key comes from**, first match wins:

1. ``bl.Runner(path, redaction_key=...)``: the key itself (``bytes``), or the path of a
   file holding it (``str`` or ``os.PathLike``);
2. ``$BOUNDLOOP_REDACTION_KEY_FILE``: the path of a file holding it (empty means unset);
3. otherwise one key per journal in the user's state directory,
   ``$XDG_STATE_HOME/boundloop/keys/<journal id>.key`` (an ``XDG_STATE_HOME`` that is not
   an absolute path is ignored, as the XDG spec says), else
   ``~/.local/state/boundloop/keys/<journal id>.key``. The journal id is 32 random hex
   digits stored in the journal's meta table when it first needs a key. boundloop creates
   that file (32 random bytes) the first time, mode ``0600``, and the ``boundloop`` and
   ``keys`` directories ``0700``, whatever the umask; a key file there that another user
   owns is refused.

A key file holds the key as raw bytes, exactly (nothing is stripped): ``head -c 32
/dev/urandom > key`` makes one. Keys shorter than 32 bytes, and keys of only zero bytes,
are refused with ``ConfigError``, as is a key file inside the journal directory (or a state
directory under it): the key is never stored where a copy of the journal would carry it.

**The journal keeps only a fingerprint**: HMAC-SHA256 of a fixed label under the key, in
its meta table, recorded the first time a writer binds a key. A runner given another key
than the journal's is refused with ``ConfigError`` (its digests would never match the
journal's); the message says where the key was expected. The fingerprint cannot confirm a
guessed secret: it depends on the key alone, which is 256 bits or more.

**Workers that share a journal share its key.** Processes of one user on one machine find
it in that user's state directory. Workers running as other users, in containers with their
own home, or on other machines (a PostgreSQL journal) must be given the same key: copy the
key file (``<state dir>/boundloop/keys/<journal id>.key``, named in the ``ConfigError`` a
worker without it gets) to each of them, kept ``0600``, and point ``redaction_key=`` or
``$BOUNDLOOP_REDACTION_KEY_FILE`` at it. A journal created with ``redaction_key=`` or the
environment variable needs that same key from every writer.

**A key file inside the journal directory** (``redaction.key``, left by an older boundloop
that kept its key there) is adopted once, and never created: the first time a writer opens
such a journal without ``redaction_key=`` or the environment variable, and the journal has
no fingerprint yet and already holds runs (it really is an older version's journal), the
file's key is copied into the state directory and its fingerprint recorded, so the runs
recorded before the upgrade keep digests that match the new ones. It is adopted only when
it is a regular file of this user that nobody else can write, of exactly 32 bytes (what
older versions wrote) and not all zero; anything else (a fresh or empty journal directory
with such a file in it, a file someone else could have planted, an all-zero key) is never
used, and the journal gets a new random key instead. The file itself is left where it is:
anyone with a copy of the directory can use it to confirm guesses, so ``boundloop verify``
warns about it (``boundloop.ops.key_file_warning``; a warning, it does not change the
exit status) until it is moved out (the state directory already holds a copy).

**Read-only opens** (``boundloop show``, ``export``...) create and write nothing: ``find``
returns the journal's key when one that matches its fingerprint can be read (the
environment variable, then the state directory), else None; the reader then works
without the journal's key (it stores no digests; ``LmdbJournal.secret_key`` is then a
random key of that open's own, so what an export digests confirms nothing either).

Runners in one process share one open journal (LMDB allows one environment per process):
the first binds its key, and a later one must give the same key or none. A Runner given a
Journal object rather than a path hands ``redaction_key=`` to the journal when it can take
one (``bind_key``), else only checks it is the journal's key.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import secrets
import stat
import threading
from pathlib import Path
from typing import Any

from boundloop.errors import ConfigError, JournalCorrupt

#: The environment variable naming a key file.
ENV_VAR = "BOUNDLOOP_REDACTION_KEY_FILE"
#: The key file older versions kept inside the journal directory (adopted once, see above).
LEGACY_KEY_FILE = "redaction.key"
#: The shortest key accepted, and the size of the keys boundloop makes.
MIN_KEY_BYTES = 32
#: Key files larger than this are refused (a path to /dev/zero or a big file by mistake).
MAX_KEY_BYTES = 64 * 1024
#: What the fingerprint is the HMAC of.
FINGERPRINT_LABEL = b"boundloop redaction key fingerprint v1"
#: Meta-table entries: the journal's id (names its key file) and its key's fingerprint.
META_JOURNAL_ID = b"journal_id"
META_FINGERPRINT = b"key_fingerprint"

#: What ``redaction_key=`` accepts: the key's bytes, or the path of a file holding it.
KeySource = bytes | bytearray | memoryview | str | os.PathLike[str]

_JOURNAL_ID = re.compile(r"[0-9a-f]{32}")
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")


# -- keys and fingerprints ---------------------------------------------------------------
def fingerprint(key: bytes) -> str:
    """The key's fingerprint (hex), the only trace of it a journal keeps."""
    return hmac.new(key, FINGERPRINT_LABEL, hashlib.sha256).hexdigest()


def check_key(key: bytes, where: str) -> bytes:
    """``key`` when it may be a redaction key, else ConfigError naming ``where`` it came
    from: at least ``MIN_KEY_BYTES`` bytes, not all zero."""
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"the redaction key from {where} is {len(key)} bytes; a key must be "
                          f"at least {MIN_KEY_BYTES} random bytes (e.g. `head -c 32 "
                          "/dev/urandom > keyfile`)")
    if not any(key):
        raise ConfigError(f"the redaction key from {where} is all zero bytes, which anyone "
                          "could guess; use random bytes (e.g. `head -c 32 /dev/urandom > "
                          "keyfile`)")
    return key


def new_journal_id() -> str:
    """A fresh journal id: 32 random hex digits."""
    return secrets.token_hex(16)


def journal_id_of(raw: bytes | None, journal: str) -> str | None:
    """The journal id stored in a meta table (None when there is none yet).

    Raises:
        JournalCorrupt: the stored id is not 32 hex digits (it names a file: nothing else
            may reach a path).
    """
    if raw is None:
        return None
    text = raw.decode("ascii", "replace")
    if not _JOURNAL_ID.fullmatch(text):
        raise JournalCorrupt(f"the journal at {journal} has a malformed id in its meta table "
                             f"({text[:40]!r}); restore it from a backup")
    return text


def fingerprint_of(raw: bytes | None, journal: str) -> str | None:
    """The key fingerprint stored in a meta table (None when there is none yet).

    Raises:
        JournalCorrupt: it is not 64 hex digits.
    """
    if raw is None:
        return None
    text = raw.decode("ascii", "replace")
    if not _FINGERPRINT.fullmatch(text):
        raise JournalCorrupt(f"the journal at {journal} has a malformed key fingerprint in "
                             "its meta table; restore it from a backup")
    return text


def check_fingerprint(key: bytes, recorded: str | None, where: str, journal: str,
                      journal_id: str | None = None) -> None:
    """Refuse ``key`` when the journal recorded another key's fingerprint.

    Raises:
        ConfigError: the fingerprints differ; the message says what to do.
    """
    if recorded is None or hmac.compare_digest(fingerprint(key), recorded):
        return
    default = f" (by default it is kept at {key_path(journal_id)})" \
        if journal_id is not None and _state_dir_known() else ""
    raise ConfigError(
        f"the redaction key from {where} is not the key of the journal at {journal} (its "
        f"fingerprint {fingerprint(key)[:16]}... differs from the journal's "
        f"{recorded[:16]}...): digests written with it would never match the journal's. Give "
        "this runner the key the journal was created with, the same redaction_key= or "
        f"${ENV_VAR} file{default}, or use a new journal directory")


# -- where keys are kept -------------------------------------------------------------------
def state_dir() -> Path:
    """``$XDG_STATE_HOME/boundloop/keys``, else ``~/.local/state/boundloop/keys``.

    Raises:
        ConfigError: neither a usable ``$XDG_STATE_HOME`` nor a home directory is known.
    """
    xdg = os.environ.get("XDG_STATE_HOME", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "boundloop" / "keys"
    try:
        home = Path.home()
    except (RuntimeError, KeyError, OSError):
        raise ConfigError("boundloop cannot find a state directory for the journal's "
                          "redaction key (no home directory): set $XDG_STATE_HOME, "
                          f"${ENV_VAR}, or give redaction_key=") from None
    return home / ".local" / "state" / "boundloop" / "keys"


def _state_dir_known() -> bool:
    try:
        state_dir()
    except ConfigError:
        return False
    return True


def key_path(journal_id: str) -> Path:
    """The file of the journal's key in the state directory."""
    return state_dir() / f"{journal_id}.key"


def _inside(path: Path, journal_dir: Path) -> bool:
    try:
        Path(os.path.realpath(path)).relative_to(os.path.realpath(journal_dir))
    except ValueError:
        return False
    return True


def _refuse_inside(path: Path, journal_dir: Path | None, what: str) -> None:
    if journal_dir is not None and _inside(path, journal_dir):
        raise ConfigError(f"{what} {path} is inside the journal directory {journal_dir}: a "
                          "copy of the journal would carry the key and confirm guessed "
                          "secrets; keep the key outside it")


# -- reading ---------------------------------------------------------------------------------
def _read_file(path: Path, where: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ConfigError(f"cannot read the redaction key file {path} ({where}): "
                          f"{exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"the redaction key file {path} ({where}) is not a regular file")
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_KEY_BYTES + 1)
    if len(data) > MAX_KEY_BYTES:
        raise ConfigError(f"the redaction key file {path} ({where}) is larger than "
                          f"{MAX_KEY_BYTES} bytes; it is not a key file")
    return data


def given_key(source: KeySource | None, journal_dir: Path | None = None,
              *, env: bool = True) -> tuple[bytes, str] | None:
    """The key given explicitly (``source``), else by ``$BOUNDLOOP_REDACTION_KEY_FILE``
    (when ``env``), with a description of where it came from; None when neither is set.

    Raises:
        ConfigError: the source is of the wrong type, the file cannot be read or lies inside
            ``journal_dir``, or the key is too short or all zero.
    """
    if source is not None:
        if isinstance(source, bytes | bytearray | memoryview):
            return check_key(bytes(source), "redaction_key="), "redaction_key="
        if isinstance(source, str | os.PathLike):
            path = Path(os.fspath(source))
            if not path.exists():
                # Not echoed: a str given here by mistake may be the key itself.
                raise ConfigError("redaction_key= names no file (a str or a path is the path "
                                  "of a key file; give the key itself as bytes)")
            where = f"redaction_key={str(path)!r}"
            _refuse_inside(path, journal_dir, "the redaction key file")
            return check_key(_read_file(path, "redaction_key="), where), where
        raise ConfigError("redaction_key must be the key's bytes or the path of a file "
                          f"holding it, not a {type(source).__name__}")
    named = os.environ.get(ENV_VAR, "") if env else ""
    if not named:
        return None
    path = Path(named)
    where = f"${ENV_VAR}={named!r}"
    _refuse_inside(path, journal_dir, f"the redaction key file (${ENV_VAR})")
    return check_key(_read_file(path, f"${ENV_VAR}"), where), where


def _read_state_key(path: Path) -> bytes | None:
    """The key in our own state file (made private again if its mode drifted), None when
    there is none.

    Raises:
        ConfigError: it is not a regular file, belongs to another user, or is not a key.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read the redaction key file {path}: "
                          f"{exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"the redaction key file {path} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            raise ConfigError(f"the redaction key file {path} belongs to another user "
                              f"(uid {st.st_uid}); it may have been planted: remove it, or "
                              f"give the journal's key by ${ENV_VAR}")
        if stat.S_IMODE(st.st_mode) != 0o600:
            os.fchmod(f.fileno(), 0o600)
        data = f.read(MAX_KEY_BYTES + 1)
    if len(data) > MAX_KEY_BYTES:
        raise ConfigError(f"the redaction key file {path} is not a key file (too large)")
    return check_key(data, str(path))


# -- writing (the state directory only) --------------------------------------------------
def _private_dir(path: Path, create: bool = True) -> None:
    """Make ``path`` (and missing parents) exist (when ``create``); ``boundloop`` and
    ``keys`` end ``0700``, and must be this user's."""
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    elif not path.is_dir():
        return
    for d in (path.parent, path):
        st = os.stat(d, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{d} is not a directory; boundloop keeps its redaction keys "
                              "there")
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            raise ConfigError(f"{d} belongs to another user (uid {st.st_uid}); boundloop "
                              "will not keep redaction keys there: set $XDG_STATE_HOME or "
                              f"${ENV_VAR}")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(d, 0o700)


def _create_state_key(path: Path, key: bytes | None = None) -> bytes:
    """Write ``key`` (default: a new random key) at ``path`` (``0600``), or read the one
    another process wrote first: written whole under a private name, then linked into
    place."""
    _private_dir(path.parent)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # whatever the umask
            f.write(key if key is not None else secrets.token_bytes(MIN_KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):  # another process made it first: use it
            os.link(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    with contextlib.suppress(OSError):  # the link itself durable, where the OS allows
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    key = _read_state_key(path)
    assert key is not None
    return key


# -- resolution ------------------------------------------------------------------------------
def resolve(source: KeySource | None, *, journal_id: str, recorded: str | None,
            journal_dir: Path | None, journal: str | None = None,
            has_runs: bool = False) -> bytes:
    """The key a writer of the journal uses (see the module's docstring for the order),
    checked against the fingerprint the journal ``recorded`` (None: none yet, any key is
    taken; the caller records its fingerprint). Creates the state-directory key only for a
    journal that has no fingerprint yet: the old key file of a journal that ``has_runs``
    (``adoptable_legacy_key``), else a new random key.

    ``journal_dir`` is the journal's directory (None for a journal that has none, such as a
    database: no key may then lie inside it, and there is no old key file); ``journal``
    names the journal in messages.

    Raises:
        ConfigError: the key is refused (see ``given_key``), does not match ``recorded``, or
            the journal has a key that is not where it is looked for.
    """
    name = journal or str(journal_dir)
    given = given_key(source, journal_dir)
    if given is not None:
        key, where = given
    else:
        path = key_path(journal_id)
        _refuse_inside(path, journal_dir, "the state directory's key file")
        where = str(path)
        _private_dir(path.parent, create=False)
        found = _read_state_key(path)
        if found is None:
            if recorded is not None:
                raise ConfigError(
                    f"the journal at {name} has a redaction key (fingerprint "
                    f"{recorded[:16]}...) that is not in {path}: it was created with "
                    f"redaction_key= or ${ENV_VAR}, or by another user or on another machine "
                    "(whose state directory holds it as "
                    f"boundloop/keys/{journal_id}.key). Give this runner the same key: "
                    f"redaction_key=<path of a copy of that file> or ${ENV_VAR}")
            legacy = adoptable_legacy_key(journal_dir) \
                if has_runs and journal_dir is not None else None
            found = _create_state_key(path, legacy)
        key = found
    check_fingerprint(key, recorded, where, name, journal_id)
    return key


def find(journal_id: str | None, recorded: str | None) -> bytes | None:
    """The journal's key for a read-only open, or None: the first of
    ``$BOUNDLOOP_REDACTION_KEY_FILE`` and the state-directory key that can be read and
    matches the ``recorded`` fingerprint. Creates nothing, writes nothing, never raises."""
    if recorded is None:
        return None
    candidates: list[Any] = []
    with contextlib.suppress(ConfigError, OSError):
        env = given_key(None)
        if env is not None:
            candidates.append(env[0])
    if journal_id is not None:
        with contextlib.suppress(ConfigError, OSError):
            candidates.append(_peek_state_key(key_path(journal_id)))
    for key in candidates:
        if isinstance(key, bytes) and hmac.compare_digest(fingerprint(key), recorded):
            return key
    return None


def _peek_state_key(path: Path) -> bytes | None:
    """``_read_state_key`` without fixing anything (a reader changes no file)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (hasattr(os, "geteuid") and st.st_uid != os.geteuid()):
        os.close(fd)
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_KEY_BYTES + 1)
    return data if MIN_KEY_BYTES <= len(data) <= MAX_KEY_BYTES and any(data) else None


def bind(journal: Any, source: KeySource | None) -> None:
    """Give ``journal`` the runner's key (``Journal.bind_key``: a journal that resolves keys
    itself, as LmdbJournal, is handed ``source``; any other must already hold the same key
    when ``source`` is given).

    Raises:
        ConfigError: the key is refused or is not the journal's.
    """
    journal.bind_key(source)


# -- the old key file ------------------------------------------------------------------------
def legacy_key_file(journal_dir: str | os.PathLike[str]) -> Path | None:
    """The key file an older boundloop left inside the journal directory, if any."""
    path = Path(journal_dir) / LEGACY_KEY_FILE
    return path if path.is_file() else None


def adoptable_legacy_key(journal_dir: Path) -> bytes | None:
    """The key in the journal directory's old key file when it may be adopted, else None:
    a regular file (not a link) of this user, writable by nobody else, holding exactly 32
    bytes (what older versions wrote) that are not all zero. Reads only; never raises."""
    path = journal_dir / LEGACY_KEY_FILE
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o022 or (
                hasattr(os, "geteuid") and st.st_uid != os.geteuid()):
            return None
        data = os.read(fd, MIN_KEY_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) == MIN_KEY_BYTES and any(data) else None


class KeyedJournal:
    """The key half of a journal backend: ``bind_key`` and ``secret_key`` (SPEC 9), over
    the backend's own ``_read_key`` (a reader's key: writes nothing) and ``_load_key`` (a
    writer's: records the journal id and the fingerprint). Mixed in before ``Journal``."""

    readonly: bool
    _key: bytes | None
    _key_lock: threading.Lock

    def _read_key(self) -> bytes:
        raise NotImplementedError

    def _load_key(self, source: KeySource | None = None) -> bytes:
        raise NotImplementedError

    def _key_place(self) -> tuple[Path | None, str]:
        """The journal directory (None for a database) and how messages name the journal."""
        raise NotImplementedError

    def bind_key(self, source: KeySource | None) -> bytes:
        """Use the key ``source`` gives (``bl.Runner(redaction_key=...)``; None: the
        environment variable or the state directory), checked against the journal's
        fingerprint. A journal that already has its key (another Runner in this process
        bound it) keeps it: ``source`` must then be the same key.

        Raises:
            ConfigError: the key is refused, or is not the journal's.
        """
        with self._key_lock:
            if self._key is None:
                self._key = self._load_key(source)
                return self._key
            key = self._key
        directory, where = self._key_place()
        given = given_key(source, directory, env=False)
        if given is not None:
            check_fingerprint(given[0], fingerprint(key), given[1], where)
        return key

    @property
    def secret_key(self) -> bytes:
        """The key redacted values are digested under (resolved on first use). A read-only
        open without the journal's key gets a random one."""
        key = self._key
        if key is None:
            with self._key_lock:
                if self._key is None:
                    self._key = self._read_key() if self.readonly else self._load_key()
                key = self._key
        return key
