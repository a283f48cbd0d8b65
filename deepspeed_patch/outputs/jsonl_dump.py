# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The JSONL post-mortem dump (``JsonlDump``): one line per measured step in a file that rotates past a size, read
after a crash, a rollback or a resume (``publish.py`` decides what goes in, and that rank 0 alone writes it)."""

import json
import os
from typing import Any, Dict


class JsonlDump:
    """One JSON line per measured step, flushed as written, rotated past ``max_bytes`` (rank 0 only).

    Lines are only ever appended: a run resumed or rolled back to an earlier checkpoint writes its repeated
    steps again, after the first run's. The rule for readers (``plot``, ``report``): one entry per step, the
    line written last wins, and the later steps only the abandoned run wrote are dropped: training went on
    from the new lines.
    """

    def __init__(self, path: str, max_bytes: int, backups: int) -> None:
        self.path, self.max_bytes, self.backups = path, max_bytes, backups

    def write(self, record: Dict[str, Any]) -> None:
        line = json.dumps(record, default=str) + "\n"
        if os.path.exists(self.path) and os.path.getsize(self.path) + len(line) > self.max_bytes:
            self._rotate()
        with open(self.path, "a") as out:
            out.write(line)
            out.flush()

    def _rotate(self) -> None:
        for index in range(self.backups - 1, 0, -1):
            if os.path.exists(f"{self.path}.{index}"):
                os.replace(f"{self.path}.{index}", f"{self.path}.{index + 1}")
        if self.backups > 0:
            os.replace(self.path, f"{self.path}.1")
        else:
            os.remove(self.path)
