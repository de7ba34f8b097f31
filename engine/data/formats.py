"""The forms a corpus takes on disk, told apart by their names alone: a text file, a folder
of text files, a JSONL file (one record a line), a folder written by `datasets`.

No torch and no reading of the documents here, so that a command can check a data path
against the settings that go with it (a text field) before anything heavy starts.
"""

from __future__ import annotations

import os
from pathlib import Path

# Files a folder corpus reads: prose and source code. Anything else in the folder (images,
# archives, lock files) is skipped rather than decoded as garbage.
TEXT_SUFFIXES = frozenset(
    ".txt .text .md .markdown .rst .tex .html .htm .py .pyi .c .h .cc .cpp .hpp .rs .go "
    ".java .js .ts .sh .jsonl".split()
)
RECORDS_SUFFIX = ".jsonl"  # a file of JSON records, the text in one of their fields
DATASETS_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
TEXT_FIELD = "text"  # the JSONL field or `datasets` column read unless another is named
# What holds its text in a field, in the words of a message about a text field.
WITH_FIELDS = "a JSONL file, a folder holding JSONL files, or a `datasets` folder"


def is_datasets_folder(path: Path) -> bool:
    """Whether `path` is a folder written by `datasets`' `save_to_disk`."""
    return any((path / marker).is_file() for marker in DATASETS_MARKERS)


def is_records(path: Path) -> bool:
    """Whether the file at `path` is read as JSON records rather than as one text."""
    return path.suffix.lower() == RECORDS_SUFFIX


def has_fields(path: Path) -> bool:
    """Whether a corpus at `path` (which exists) holds its text in a field that a text
    field names: a JSONL file, a `datasets` folder, or a folder with a JSONL file among
    the text files it reads. A plain text file, or a folder of them, has none."""
    if path.is_file():
        return is_records(path)
    if is_datasets_folder(path):
        return True
    for _, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # as a folder corpus reads it
        if any(not name.startswith(".") and is_records(Path(name)) for name in names):
            return True
    return False
