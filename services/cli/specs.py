"""Job files as `mj launch` sends them: read, with each relative `workdir` made absolute.

A task's `workdir` names a folder on the machine `mj` runs on, and a relative one
means "relative to the spec file", as SkyPilot reads it. The services cannot know
where the file was, and the local backend refuses relative workdirs (contract §14), so
`mj` resolves them against the spec file's folder (after `~` expansion) before it
submits.

Only the value of a top-level `workdir` key of each YAML document is rewritten, in
place: the rest of the file is sent byte for byte as written (comments, anchors,
formatting), so the scheduler's validation and its error messages see what the
user wrote. The YAML is composed, never constructed, so aliases are not expanded
here; a `workdir` given through an alias, an anchor, a tag or a block scalar is
left as it is. A file that does not parse is sent unchanged: the scheduler says
what is wrong with it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from services.cli.exit_codes import UsageError


def read_spec(path: str) -> str:
    """The job file's text, with every relative task `workdir` made absolute.

    Raises:
        UsageError: the file cannot be read.
    """
    try:
        with open(path, encoding="utf-8") as spec:
            text = spec.read()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise UsageError(f"cannot read {path}: {reason}") from None
    return absolute_workdirs(text, Path(os.path.abspath(path)).parent)


def absolute_workdirs(text: str, folder: Path) -> str:
    """`text` with each document's relative `workdir` joined to `folder` (absolute)."""
    try:
        documents = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError:
        return text
    edits: list[tuple[int, int, str]] = []
    for document in documents:
        if not isinstance(document, yaml.MappingNode):
            continue
        for key, value in document.value:
            if not (isinstance(key, yaml.ScalarNode) and key.value == "workdir"):
                continue
            if not isinstance(value, yaml.ScalarNode) or value.tag != "tag:yaml.org,2002:str":
                continue  # not a string: the scheduler refuses it by its field path
            start, end = value.start_mark.index, value.end_mark.index
            if start < key.end_mark.index or text[start:end].startswith(("&", "!", "|", ">")):
                continue  # an alias, anchor, tag or block scalar: a rewrite would change more
            workdir = os.path.expanduser(value.value)
            if not workdir or (os.path.isabs(workdir) and workdir == value.value):
                continue
            absolute = os.path.normpath(os.path.join(folder, workdir))
            # A JSON string is a YAML double-quoted scalar: any path fits, quotes and all.
            edits.append((start, end, json.dumps(absolute)))
    for start, end, replacement in sorted(edits, reverse=True):
        text = text[:start] + replacement + text[end:]
    return text
