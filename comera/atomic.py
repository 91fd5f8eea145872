"""Crash-safe file writes for checkpoints.

A checkpoint is written to a temporary file in the destination's directory,
flushed and fsynced, then moved over the destination with ``os.replace``
(atomic on POSIX and Windows within one file system), and the directory
entry is fsynced too.  A crash or an exception while writing leaves the
previous checkpoint intact and removes the temporary file.
"""
import os
import tempfile
from typing import Callable, Union

PathLike = Union[str, "os.PathLike[str]"]


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems that refuse it
        pass
    finally:
        os.close(fd)


def atomic_write(path: PathLike, write: Callable[[str], None]) -> None:
    """Calls ``write(tmp_path)`` to produce the file, then moves it to ``path``.

    ``write`` gets the name of an empty temporary file next to ``path`` and
    must write the whole content there (``torch.save(obj, tmp_path)``,
    ``safetensors.torch.save_file(d, tmp_path)``...).  ``path`` is replaced
    only once the new content is complete and on disk.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "note.txt")
        >>> def write(tmp):
        ...     with open(tmp, "w") as f:
        ...         f.write("hello")
        >>> atomic_write(path, write)
        >>> open(path).read()
        'hello'
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.",
                               suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        # mkstemp makes the file private (0600), and some writers recreate
        # it: give it the mode the old file had, or the usual 0644
        mode = os.stat(path).st_mode & 0o777 if os.path.exists(path) else 0o644
        os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)
