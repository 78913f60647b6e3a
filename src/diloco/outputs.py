"""Output folders and files: a folder that cannot be used, or a write that fails (a full disk, a folder
made read-only), is refused in one line naming the path and the reason."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from diloco.errors import DilocoError


def output_folder(out: Path) -> Path:
    """`out`, created if needed, once it is known to be a folder this process can write into."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise DilocoError(f"--out {out} is a file, not a folder") from None
    except OSError as exc:
        raise DilocoError(f"cannot create --out {out}: {exc.strerror or exc}") from None
    probe = out / f".diloco-write-test-{os.getpid()}-{time.monotonic_ns()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise DilocoError(f"cannot write into --out {out}: {exc.strerror or exc}") from None
    return out


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Within it, an OSError (whose message may not say which file) is an error that names `path`."""
    try:
        yield
    except OSError as exc:
        raise DilocoError(f"cannot write {path}: {exc.strerror or exc}") from None


@contextlib.contextmanager
def replacing(path: Path, *, binary: bool = False, durable: bool = False) -> Iterator[IO]:
    """A file to write that replaces `path` whole when the block ends: a process killed mid-write, or a
    reader polling it, finds the old contents or the new, never a torn file. `durable` syncs it to disk
    before the rename, for files a restart reads back. A failure leaves the old file and no partial one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(partial, "w+b" if binary else "w") as file:
            yield file
            if durable:
                file.flush()
                os.fsync(file.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def write_output(path: Path, text: str, *, durable: bool = False) -> None:
    """Write one output file whole (see `replacing`), its folder created if needed; a failure names it."""
    with writing(path), replacing(path, durable=durable) as file:
        file.write(text)
