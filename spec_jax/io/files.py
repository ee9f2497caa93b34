"""Writes that are whole or absent: a crash leaves the old file or directory,
or the new one, never half of one."""

import contextlib
import os
import pathlib
import shutil
import tempfile


@contextlib.contextmanager
def atomic_directory(path):
  """Yields a staging directory; on success it replaces `path` whole.

  The staging directory sits beside path (same file system, so the final
  rename is atomic) and is removed if the body raises.
  """
  path = pathlib.Path(path).absolute()
  staging = path.with_name(path.name + ".partial")
  shutil.rmtree(staging, ignore_errors=True)
  staging.mkdir(parents=True)
  try:
    yield staging
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  if path.exists():
    shutil.rmtree(path)
  os.replace(staging, path)


def write_atomic(path, write, mode: str = "w") -> None:
  """Calls write(file) on a temporary file beside path, then renames it to
  path."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  with tempfile.NamedTemporaryFile(mode, dir=directory, suffix=".tmp",
                                   delete=False) as f:
    try:
      write(f)
    except BaseException:
      f.close()
      os.remove(f.name)
      raise
  # tempfile creates the file private (0600); give it the usual mode.
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(f.name, 0o666 & ~umask)
  os.replace(f.name, path)
