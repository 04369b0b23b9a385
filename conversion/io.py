"""Checking source checkpoints (GGUF files) and writing folders atomically: nothing the user has is lost."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import shutil
import signal
import socket
import struct
import threading
from pathlib import Path
from typing import NamedTuple


logger = logging.getLogger(__name__)

# Files a converted (or exported) folder carries over from its source unchanged.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "vocab.json",
    "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
GENERATION_CONFIG = "generation_config.json"
SIDE_FILES = (*TOKENIZER_FILES, GENERATION_CONFIG)


# GGUF metadata value types (gguf-py's `GGUFValueType`) -> byte size of one value; 8 = string, 9 = array
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class GGUFTensorInfo(NamedTuple):
    """One tensor of a GGUF file's table: `dims` in GGUF's order (the fastest-varying first), `kind` its
    `GGMLQuantizationType`, `start` its first byte in the file, `nbytes` its size."""

    name: str
    dims: tuple[int, ...]
    kind: int
    start: int
    nbytes: int


class GGUFLayout(NamedTuple):
    """What a GGUF file's header says: `general.architecture` and the table of tensors."""

    architecture: str | None
    tensors: list[GGUFTensorInfo]


def check_gguf(path) -> GGUFLayout:
    """Walk a GGUF file's header and tensor table; raise a `ValueError` naming the file and what is wrong
    (not a GGUF file, truncated in the header or in a tensor's data, an unknown type) before anything
    tries to reshape its bytes. Reads only the header (memory-mapped), not the tensor data. Returns the
    architecture and the table (empty without gguf-py, which knows the types' sizes)."""
    path = Path(path)
    size = path.stat().st_size
    if size < 24:
        raise ValueError(f"{path} is truncated: {size} bytes, shorter than a GGUF header.")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file: it starts with {bytes(data[:4])!r}, not b'GGUF'.")
        order = "<" if struct.unpack_from("<I", data, 4)[0] < 0x10000 else ">"  # GGUF may be big-endian
        version = struct.unpack_from(order + "I", data, 4)[0]
        if version not in (2, 3):
            raise ValueError(f"{path} is damaged or unsupported: GGUF version {version} (readable: 2, 3).")
        return _GGUFWalk(path, data, order).walk()


class _GGUFWalk:
    """A cursor over a memory-mapped GGUF file that names where it ran out of bytes."""

    def __init__(self, path: Path, data, order: str):
        self.path, self.data, self.order, self.pos, self.where = path, data, order, 8, "the header"
        self.architecture = None

    def take(self, fmt: str):
        width = struct.calcsize(fmt)
        if self.pos + width > len(self.data):
            raise ValueError(f"{self.path} is truncated: it ends at byte {len(self.data)}, inside {self.where}.")
        value = struct.unpack_from(self.order + fmt, self.data, self.pos)[0]
        self.pos += width
        return value

    def skip(self, count: int) -> None:
        if count < 0 or self.pos + count > len(self.data):
            raise ValueError(
                f"{self.path} is truncated or damaged: {self.where} needs {count} bytes from byte {self.pos}, "
                f"the file has {len(self.data)}."
            )
        self.pos += count

    def string(self) -> str:
        length = self.take("Q")
        start = self.pos
        self.skip(length)
        return bytes(self.data[start:self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int, key: str) -> None:
        if kind in _GGUF_SCALARS:
            self.skip(_GGUF_SCALARS[kind])
        elif kind == _GGUF_STRING:
            self.skip(self.take("Q"))
        elif kind == _GGUF_ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item in _GGUF_SCALARS:
                self.skip(_GGUF_SCALARS[item] * count)
            else:
                for _ in range(count):
                    self.value(item, key)
        else:
            raise ValueError(f"{self.path} is damaged: metadata {key!r} has unknown value type {kind}.")

    def walk(self) -> GGUFLayout:
        tensors, entries = self.take("Q"), self.take("Q")
        alignment = 32
        for i in range(entries):
            self.where = f"metadata entry {i + 1} of {entries}"
            key = self.string()
            self.where = f"metadata {key!r}"
            kind = self.take("I")
            if key == "general.alignment" and kind == 4:
                alignment = self.take("I")
            elif key == "general.architecture" and kind == _GGUF_STRING:
                self.architecture = self.string()
            else:
                self.value(kind, key)
        infos = []
        for i in range(tensors):
            self.where = f"the table of tensors (entry {i + 1} of {tensors})"
            name = self.string()
            dims = self.take("I")
            if dims > 4:
                raise ValueError(f"{self.path} is damaged: tensor {name!r} claims {dims} dimensions (at most 4).")
            shape = [self.take("Q") for _ in range(dims)]
            infos.append((name, shape, self.take("I"), self.take("Q")))
        start = -(-self.pos // alignment) * alignment if alignment > 0 else self.pos
        try:
            from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        except ImportError:  # without gguf-py the byte sizes are unknown: the table was still walked
            return GGUFLayout(self.architecture, [])
        table = []
        for name, shape, kind, offset in infos:
            try:
                block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise ValueError(f"{self.path} is damaged: tensor {name!r} has unknown tensor type {kind}.") from None
            count = 1
            for n in shape:
                count *= n
            end = start + offset + count // block * nbytes
            if end > len(self.data):
                raise ValueError(
                    f"{self.path} is truncated: tensor {name!r} ends at byte {end} but the file has "
                    f"{len(self.data)} bytes ({end - len(self.data)} missing)."
                )
            table.append(GGUFTensorInfo(name, tuple(shape), kind, start + offset, count // block * nbytes))
        return GGUFLayout(self.architecture, table)


def copy_side_files(src: Path, dst: Path, names=SIDE_FILES, replace: bool = False) -> None:
    """Copy the tokenizer files and generation config of `src` into `dst`.

    Files `dst` holds already are kept, or replaced with `replace`; the generation config always replaces the one
    `save_pretrained` derived from the model's config, which lacks what the source's adds (Gemma 3's second
    end-of-turn id, sampling defaults)."""
    for name in names:
        if (src / name).exists() and (replace or name == GENERATION_CONFIG or not (dst / name).exists()):
            shutil.copy2(src / name, dst / name)


PARTIAL = ".{name}.partial-"  # prefix of the temporary folder next to OUT
OLD = ".{name}.old-"  # the replaced OUT, for the moment of the swap under `force`


def check_destination(out, force: bool = False, sources=()) -> None:
    """Refuse an output folder that would lose data: one that is a source or contains one (never
    removed, even with `force`), and an existing one without `force`. An OUT inside a source is
    allowed: it removes nothing of the source (the readers take only the source's top-level files)."""
    out = Path(out)
    target = out.resolve()
    for source in sources:
        source = Path(source).resolve()
        if target == source or target in source.parents:
            what = "is" if target == source else "contains"
            raise ValueError(
                f"{out} {what} the source {source}: writing there would delete the source; "
                "choose another output folder."
            )
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists; pass `force=True` to replace it.")
    base = target.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not os.access(base, os.W_OK | os.X_OK):  # say so now, not after the whole conversion
        raise PermissionError(f"cannot write {out}: its folder {base} is not writable.")


def _partial_name(out: Path, prefix: str = PARTIAL) -> str:
    # host and pid let a later run tell a dead run's leftovers from a running one's
    return f"{prefix.format(name=out.name)}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def _pid_alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill(pid, 0) would terminate the process there: assume it runs
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def clean_stale_partials(out) -> list[Path]:
    """Find temporary folders a killed run left next to `out` (`.OUT.partial-*`). Those of a process of
    this host that is gone are removed and reported; others (another host's, a run still going, an
    older name without a pid) are reported and left alone, as is a `.OUT.old-*` (the previous OUT of a
    `force` run killed in the middle of its swap: only the user knows whether to move it back).
    Returns the folders still there."""
    out = Path(out)
    kept = []
    if not out.parent.is_dir():
        return kept
    prefix = PARTIAL.format(name=out.name)
    for path in sorted(out.parent.glob(prefix + "*")):
        host, pid = _owner(path.name[len(prefix):])
        if host == socket.gethostname() and pid is not None and pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                logger.warning(f"removed {path}: partial output of an interrupted run (pid {pid}, no longer running).")
                continue
        kept.append(path)
        logger.warning(f"found {path}: partial output of another run (still running, or interrupted); remove it if "
                       "no conversion into this folder is running.")
    for path in sorted(out.parent.glob(OLD.format(name=out.name) + "*")):
        kept.append(path)
        logger.warning(f"found {path}: the previous {out.name} of an interrupted `--force` run; move it back or "
                       "remove it.")
    return kept


def _owner(tail: str) -> tuple[str | None, int | None]:
    parts = tail.rsplit("-", 2)
    if len(parts) == 3 and parts[1].isdigit():
        return parts[0], int(parts[1])
    return None, None


class _Interrupted(BaseException):
    """Raised by the handler `_SignalGuard` installs; a BaseException so no `except Exception` keeps it."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


class _SignalGuard:
    """SIGINT and SIGTERM raise `_Interrupted` while writing, so the `finally` that removes the temporary
    folder runs (SIGTERM's default would end the process there and then). Inside `hold()` (the cleanup and
    the final renames) a signal is only recorded. On exit the previous handlers are restored and a signal
    that arrived is delivered again to them: Ctrl-C still raises KeyboardInterrupt, SIGTERM still ends the
    process. Handlers can only be set from the main thread; elsewhere nothing is installed."""

    SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM") if hasattr(signal, name))

    def __init__(self):
        self.previous: dict[int, object] = {}
        self.received: int | None = None
        self.raised = False
        self.holding = False

    def _interrupt(self):
        self.raised = True  # one exception is enough; later signals are only passed on at the end
        raise _Interrupted(self.received)

    def _handle(self, signum, frame):
        if self.received is None:
            self.received = signum
        if not self.holding and not self.raised:
            self._interrupt()

    @contextlib.contextmanager
    def hold(self):
        """Record signals instead of raising; raise the recorded one when the outermost hold ends."""
        outer, self.holding = self.holding, True
        try:
            yield
        finally:
            self.holding = outer
        if not outer and self.received is not None and not self.raised:
            self._interrupt()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                previous = signal.getsignal(signum)
                if previous is signal.SIG_IGN or previous is None:
                    continue  # an ignored signal stays ignored (e.g. SIGINT in a background job)
                self.previous[signum] = previous
                signal.signal(signum, self._handle)
        return self

    def __exit__(self, kind, error, tb):
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)
        if self.received is not None:
            signal.raise_signal(self.received)  # the previous handler decides what the signal does
            if isinstance(error, _Interrupted):
                raise KeyboardInterrupt(str(error)) from None  # it returned: still, the output was not written
        return False


def _make_partial(out: Path) -> Path:
    while True:
        tmp = out.parent / _partial_name(out)
        try:
            tmp.mkdir()  # mode 0o777 less the umask, as `save_pretrained` makes folders (mkdtemp gives 0700)
            return tmp
        except FileExistsError:
            continue
        except PermissionError:
            raise PermissionError(f"cannot write {out}: its folder {out.parent} is not writable.") from None


@contextlib.contextmanager
def atomic_folder(out: Path, force: bool = False, sources=()):
    """Yield a temporary folder next to `out`; move it to `out` only if the block completes.

    `out` may not be or contain any of `sources` (refused even with `force`); an existing `out` is
    refused unless `force` (then replaced only after success). The temporary folder is removed
    whatever interrupts the block, SIGINT and SIGTERM included (handlers installed for the duration
    of the write, the previous ones restored and the signal then passed on to them); a SIGKILL leaves
    it behind, and the next run into the same `out` removes or names it (`clean_stale_partials`).
    The folder follows the umask, like `save_pretrained`'s.
    """
    out = Path(os.path.abspath(out))  # `.` or `..` get a real name and parent; links are not followed
    check_destination(out, force, sources)
    clean_stale_partials(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except PermissionError:
        raise PermissionError(f"cannot create {out.parent} (permission denied), so {out} cannot be written.") from None
    with _SignalGuard() as guard:
        tmp = None
        try:
            with guard.hold():  # created and known, or not created
                tmp = _make_partial(out)
            yield tmp
            with guard.hold():  # no half-done swap: `out` is either the old folder or the new one
                if out.exists():
                    old = out.parent / _partial_name(out, OLD)
                    os.replace(out, old)
                    os.replace(tmp, out)
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    os.replace(tmp, out)
        finally:
            with guard.hold():
                if tmp is not None and tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
