"""Results files: atomic writes, stamped with the code version."""

import csv
import json
import os
import string
import subprocess
import tempfile

import numpy as np

from spec_jax.io import files


def code_version() -> str:
  """The git commit of this checkout, with '+dirty' for uncommitted changes
  (the installed version outside git; "unknown" for a copy of the tree)."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root,
                            capture_output=True, text=True, check=True)
    status = subprocess.run(["git", "status", "--porcelain"], cwd=root,
                            capture_output=True, text=True, check=True)
  except (OSError, subprocess.CalledProcessError):
    from importlib import metadata
    try:
      return "spec_jax-" + metadata.version("spec_jax")
    except metadata.PackageNotFoundError:  # a copy of the tree, not installed
      return "unknown"
  return commit.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def write_results(path: str, config, results: dict) -> None:
  """A results file: the code version and the config (a ConfigDict) that
  produced the results, then the results."""
  write_json(path, {"code_version": code_version(),
                    "config": config.to_dict(), **results})


def write_json(path: str, record: dict | list) -> None:
  files.write_atomic(path, lambda f: f.write(json.dumps(record, indent=2) + "\n"),
                "w")


def write_csv(path: str, rows: list[dict]) -> None:
  """One line per dict; list values are joined with ';', None left empty."""
  cell = lambda x: "" if x is None else f"{x:g}"

  def write(f):
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    for row in rows:
      writer.writerow({k: ";".join(map(cell, v)) if isinstance(v, list)
                       else v for k, v in row.items()})
  files.write_atomic(path, write, "w")


def save_npy(path: str, array: np.ndarray) -> None:
  files.write_atomic(path, lambda f: np.save(f, array), "wb")


def check_writable(directory: str) -> None:
  """Raises early, before any work, if results could not be written there."""
  try:
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryFile(dir=directory):
      pass
  except OSError as error:
    raise PermissionError(
        f"cannot write to workdir {directory!r} ({error.strerror}); pass a "
        "writable --workdir.") from error


def text_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
  """A fixed-width table for the terminal. columns: [(title, template)],
  template a `str.format` field of a row, e.g. ("tau",
  "{tokens_per_cycle:.2f}"); a title ending in "<" is left-aligned. A
  cell whose field is None (a measure that does not apply to the row)
  shows "-". Each column is as wide as its widest cell."""
  def cell(template: str, row: dict) -> str:
    fields = [name for _, name, _, _ in string.Formatter().parse(template)
              if name]
    if any(row[name] is None for name in fields):
      return "-"
    return template.format(**row)

  titles = [title.rstrip("<") for title, _ in columns]
  cells = [titles] + [[cell(template, row) for _, template in columns]
                      for row in rows]
  widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
  align = [str.ljust if title.endswith("<") else str.rjust
           for title, _ in columns]
  return "\n".join(" ".join(a(cell, w) for a, cell, w in
                             zip(align, line, widths)).rstrip()
                   for line in cells)
